//! Saying that a bucket pushes back, without a line per retry.
//!
//! Retries are debug lines (`http.rs`), so a command aimed at a wrong endpoint, or a daemon
//! whose bucket throttles it, could wait `store.retry_timeout` (3 minutes) without a word. The
//! first pushback a bucket meets is a warning at once; after that, at most one every
//! [`INTERVAL`], counting the failed attempts since the last.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The least time between two warnings about one bucket.
pub const INTERVAL: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub(super) struct Notice {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last: Option<Instant>,
    /// Failed attempts since the last warning.
    since: u64,
}

impl Notice {
    /// Counts one failed attempt at `store` (`cause`: "answered 429 Too Many Requests", "could
    /// not be reached (…)"), and warns if it is the first, or the first for [`INTERVAL`]
    /// since the last warning.
    pub fn pushed_back(&self, store: &str, cause: &str, retry_timeout: Duration) {
        let Some(count) = self.due(Instant::now()) else {
            return;
        };
        if count == 1 {
            tracing::warn!(
                "{store} {cause}: retrying for up to store.retry_timeout = {retry_timeout:?}"
            );
        } else {
            tracing::warn!(
                "{store} pushed back {count} attempts since the last notice (the last {cause}): \
                 retrying each request for up to store.retry_timeout = {retry_timeout:?}"
            );
        }
    }

    /// Counts an attempt; the count to report if a warning is due now.
    fn due(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.since += 1;
        if s.last.is_some_and(|t| now.duration_since(t) < INTERVAL) {
            return None;
        }
        s.last = Some(now);
        Some(std::mem::take(&mut s.since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_pushback_is_told_then_one_notice_per_interval_with_the_count() {
        let n = Notice::default();
        let t0 = Instant::now();
        assert_eq!(n.due(t0), Some(1));
        assert_eq!(n.due(t0 + Duration::from_secs(1)), None);
        assert_eq!(n.due(t0 + INTERVAL - Duration::from_millis(1)), None);
        // The two held back, and this one.
        assert_eq!(n.due(t0 + INTERVAL), Some(3));
        assert_eq!(n.due(t0 + INTERVAL + Duration::from_secs(1)), None);
        assert_eq!(n.due(t0 + INTERVAL * 3), Some(2));
    }
}
