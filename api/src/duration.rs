//! Kubernetes-style duration strings ("10s", "5m", "1h30m"), as `metav1.Duration` writes them.
//!
//! The string is kept verbatim so objects round-trip unchanged; [`KubeDuration::parse`] gives the typed value.
//! The schema pattern accepts exactly what CEL's `duration()` accepts, so CEL rules can compare durations.

use std::{borrow::Cow, fmt, str::FromStr, time::Duration};

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// Pattern of a Go/Kubernetes duration: one or more `<number><unit>` with units ns, us, µs, ms, s, m, h.
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$";

/// A duration as written in a spec, e.g. `"10s"`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct KubeDuration(String);

/// Why a duration string could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("duration is empty")]
    Empty,
    #[error("duration {value:?}: expected a number at byte {at}")]
    MissingNumber { value: String, at: usize },
    #[error("duration {value:?}: missing unit after {number:?} (use ns, us, ms, s, m or h)")]
    MissingUnit { value: String, number: String },
    #[error("duration {value:?}: unknown unit {unit:?} (use ns, us, ms, s, m or h)")]
    UnknownUnit { value: String, unit: String },
    #[error("duration {value:?} is too large")]
    Overflow { value: String },
    #[error("duration {value:?} must be greater than zero")]
    Zero { value: String },
}

impl KubeDuration {
    /// Wraps a string after checking that it parses.
    pub fn new(value: impl Into<String>) -> Result<Self, DurationError> {
        let value = value.into();
        parse_duration(&value)?;
        Ok(Self(value))
    }

    /// The string as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The typed value.
    pub fn parse(&self) -> Result<Duration, DurationError> {
        parse_duration(&self.0)
    }
}

impl FromStr for KubeDuration {
    type Err = DurationError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Display for KubeDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl JsonSchema for KubeDuration {
    fn schema_name() -> Cow<'static, str> {
        "KubeDuration".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
            "maxLength": 64,
            "description": "A duration such as \"10s\", \"5m\" or \"1h30m\" (units ns, us, ms, s, m, h)."
        })
    }
}

/// Parses a Go-style duration (`time.ParseDuration` without sign). Fractions are allowed ("1.5h").
pub fn parse_duration(value: &str) -> Result<Duration, DurationError> {
    if value.is_empty() {
        return Err(DurationError::Empty);
    }
    let bytes = value.as_bytes();
    let mut total_nanos: u128 = 0;
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let number = &value[start..i];
        if number.is_empty()
            || number.starts_with('.')
            || number.ends_with('.')
            || number.matches('.').count() > 1
        {
            return Err(DurationError::MissingNumber {
                value: value.to_owned(),
                at: start,
            });
        }
        let unit_start = i;
        while i < bytes.len() && !(bytes[i].is_ascii_digit() || bytes[i] == b'.') {
            i += 1;
        }
        let unit = &value[unit_start..i];
        let unit_nanos: u128 = match unit {
            "" => {
                return Err(DurationError::MissingUnit {
                    value: value.to_owned(),
                    number: number.to_owned(),
                });
            }
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3_600 * 1_000_000_000,
            other => {
                return Err(DurationError::UnknownUnit {
                    value: value.to_owned(),
                    unit: other.to_owned(),
                });
            }
        };
        let overflow = || DurationError::Overflow {
            value: value.to_owned(),
        };
        let (whole, frac) = number.split_once('.').unwrap_or((number, ""));
        let whole: u128 = whole.parse().map_err(|_| overflow())?;
        let mut nanos = whole.checked_mul(unit_nanos).ok_or_else(overflow)?;
        if !frac.is_empty() {
            // Digits past nanosecond precision cannot matter; cap them so the scale stays in range.
            let frac = &frac[..frac.len().min(18)];
            let scale = 10u128.pow(frac.len() as u32);
            let frac_value: u128 = frac.parse().map_err(|_| overflow())?;
            nanos = nanos
                .checked_add(frac_value * unit_nanos / scale)
                .ok_or_else(overflow)?;
        }
        total_nanos = total_nanos.checked_add(nanos).ok_or_else(overflow)?;
    }
    let secs = u64::try_from(total_nanos / 1_000_000_000).map_err(|_| DurationError::Overflow {
        value: value.to_owned(),
    })?;
    Ok(Duration::new(secs, (total_nanos % 1_000_000_000) as u32))
}

/// [`parse_duration`] for a setting that cannot be zero (a timeout, an interval): a binary's flag
/// parser, so each binary refuses "0s" with the same message.
pub fn parse_positive_duration(value: &str) -> Result<Duration, DurationError> {
    match parse_duration(value)? {
        d if d.is_zero() => Err(DurationError::Zero {
            value: value.to_owned(),
        }),
        d => Ok(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Duration {
        parse_duration(s).unwrap()
    }

    #[test]
    fn parses_single_units() {
        assert_eq!(d("10s"), Duration::from_secs(10));
        assert_eq!(d("5m"), Duration::from_secs(300));
        assert_eq!(d("1h"), Duration::from_secs(3600));
        assert_eq!(d("250ms"), Duration::from_millis(250));
        assert_eq!(d("7us"), Duration::from_micros(7));
        assert_eq!(d("7µs"), Duration::from_micros(7));
        assert_eq!(d("3ns"), Duration::from_nanos(3));
        assert_eq!(d("0s"), Duration::ZERO);
    }

    #[test]
    fn parses_compound_and_fractions() {
        assert_eq!(d("1h30m"), Duration::from_secs(5400));
        assert_eq!(d("1m0.5s"), Duration::from_millis(60_500));
        assert_eq!(d("1.5h"), Duration::from_secs(5400));
        assert_eq!(d("0.000000001s"), Duration::from_nanos(1));
    }

    #[test]
    fn rejects_bad_input_with_precise_errors() {
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(
            parse_duration("10"),
            Err(DurationError::MissingUnit { .. })
        ));
        assert!(
            matches!(parse_duration("10d"), Err(DurationError::UnknownUnit { unit, .. }) if unit == "d")
        );
        assert!(matches!(
            parse_duration("s"),
            Err(DurationError::MissingNumber { at: 0, .. })
        ));
        assert!(matches!(
            parse_duration("-5s"),
            Err(DurationError::MissingNumber { .. })
        ));
        assert!(matches!(
            parse_duration(".5s"),
            Err(DurationError::MissingNumber { .. })
        ));
        assert!(matches!(
            parse_duration("1.2.3s"),
            Err(DurationError::MissingNumber { .. })
        ));
        assert!(matches!(
            parse_duration("99999999999999999999999h"),
            Err(DurationError::Overflow { .. })
        ));
    }

    #[test]
    fn positive_refuses_zero_only() {
        assert_eq!(parse_positive_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(
            parse_positive_duration("0m0s"),
            Err(DurationError::Zero {
                value: "0m0s".into()
            })
        );
        assert_eq!(parse_positive_duration(""), Err(DurationError::Empty));
    }

    #[test]
    fn error_messages_name_the_value_and_the_fix() {
        let err = parse_duration("10d").unwrap_err().to_string();
        assert!(
            err.contains("\"10d\"") && err.contains("use ns, us, ms, s, m or h"),
            "{err}"
        );
    }

    #[test]
    fn keeps_the_string_verbatim() {
        let v: KubeDuration = serde_json::from_str("\"1h30m\"").unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), "\"1h30m\"");
        assert_eq!(v.parse().unwrap(), Duration::from_secs(5400));
        assert!(KubeDuration::new("soon").is_err());
    }

    #[test]
    fn schema_pattern_matches_the_parser() {
        // The server enforces the pattern, the operator the parser: they must agree on what is valid.
        let re_ok = ["10s", "5m", "1h30m", "1.5h", "250ms", "7µs", "0s"];
        let re_bad = ["", "10", "10d", "-5s", ".5s", "1h 30m"];
        for s in re_ok {
            assert!(parse_duration(s).is_ok(), "{s}");
            assert!(pattern_matches(s), "{s}");
        }
        for s in re_bad {
            assert!(parse_duration(s).is_err(), "{s}");
            assert!(!pattern_matches(s), "{s}");
        }
    }

    /// Tiny matcher for DURATION_PATTERN so the test does not need a regex crate.
    fn pattern_matches(s: &str) -> bool {
        assert_eq!(
            DURATION_PATTERN,
            r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"
        );
        let mut rest = s;
        if rest.is_empty() {
            return false;
        }
        while !rest.is_empty() {
            let digits = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            if digits == 0 {
                return false;
            }
            rest = &rest[digits..];
            if let Some(r) = rest.strip_prefix('.') {
                let frac = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
                if frac == 0 {
                    return false;
                }
                rest = &r[frac..];
            }
            let unit = ["ns", "us", "µs", "ms", "s", "m", "h"]
                .into_iter()
                .find(|u| rest.starts_with(u));
            match unit {
                Some(u) => rest = &rest[u.len()..],
                None => return false,
            }
        }
        true
    }
}
