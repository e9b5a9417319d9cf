//! Sizes and durations as an operator writes them ("1.5 GiB", "30s").

use std::time::Duration;

use super::{ConfigError, invalid};

/// Splits "1.5 GiB" into its number (if it is one, and not negative) and its unit.
fn number_and_unit(text: &str) -> (Option<f64>, String) {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n >= 0.0);
    (num, unit.trim().to_ascii_lowercase())
}

/// Parses "100GiB", "512MB", "1.5 MB", "1 TiB", "4096" (bytes), case-insensitive, exactly
/// (no floating point: parse-size computes in integers).
pub fn parse_size(text: &str, key: &str) -> Result<u64, ConfigError> {
    match parse_size::parse_size(text.trim()) {
        Ok(bytes) => Ok(bytes),
        Err(parse_size::Error::PosOverflow) => Err(invalid(format!("{key} {text:?} is too large"))),
        Err(_) => Err(invalid(format!(
            "{key} {text:?} is not a size like \"100GiB\", \"512MB\" or \"4096\""
        ))),
    }
}

/// Parses "30s", "500ms", "5m", "1h".
pub fn parse_duration(text: &str, key: &str) -> Result<Duration, ConfigError> {
    let (num, unit) = number_and_unit(text);
    let secs: f64 = match unit.as_str() {
        "ms" => 0.001,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => f64::NAN,
    };
    match num {
        // try_: `from_secs_f64` panics on a value too large for a Duration.
        Some(n) if secs.is_finite() => Duration::try_from_secs_f64(n * secs)
            .map_err(|_| invalid(format!("{key} {text:?} is too long"))),
        _ => Err(invalid(format!(
            "{key} {text:?} is not a duration like \"30s\", \"500ms\" or \"5m\""
        ))),
    }
}

/// A duration that bounds a wait: zero would fail every wait at once, so it is refused.
pub fn parse_timeout(text: &str, key: &str) -> Result<Duration, ConfigError> {
    let d = parse_duration(text, key)?;
    if d.is_zero() {
        return Err(invalid(format!("{key} {text:?} must be longer than zero")));
    }
    Ok(d)
}
