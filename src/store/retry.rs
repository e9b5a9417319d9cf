//! What a request's answer means, and when to try it again.
//!
//! A store that throttles (429), is unavailable (5xx, 408, a refused connection) or goes
//! silent (a timeout) is pushing back: the request is tried again after a truncated
//! exponential backoff with full jitter (a random wait in `[0, min(MAX_BACKOFF, FIRST_BACKOFF
//! × 2^n))`, as GCS and AWS advise: jitter spreads a pod's retries, so they do not return
//! together). Retries are bounded by time, `store.retry_timeout` from the request's first
//! failure, never by a count: a burst of 429s spends any count in seconds, while an outage
//! shorter than the timeout must be invisible to the trainer. Any other answer (404, 412,
//! another 4xx) is the request's own and final.

use std::time::{Duration, Instant};

use object_store::client::{HttpError, HttpErrorKind};

/// The first backoff's upper bound; each failure doubles it...
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// ...up to this: a request waits at most this long after a store comes back.
pub const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// How one HTTP request ended, as `shardd_store_requests_total{outcome}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A 2xx (or 3xx, 304) answer.
    Ok,
    /// 429: the bucket's request rate, or the project's egress, is exceeded.
    Throttled,
    /// 5xx, 408, or no connection: the store is down or overloaded.
    Unavailable,
    /// The store accepted the request and then went silent (`store.read_timeout`,
    /// `store.connect_timeout`).
    Timeout,
    /// Any other answer: the request's own (404, 412, 403...), not retried.
    Error,
}

impl Outcome {
    pub const ALL: [Outcome; 5] = [
        Outcome::Ok,
        Outcome::Throttled,
        Outcome::Unavailable,
        Outcome::Timeout,
        Outcome::Error,
    ];

    pub fn of_status(status: u16) -> Outcome {
        match status {
            429 => Outcome::Throttled,
            408 | 500..=599 => Outcome::Unavailable,
            100..=399 => Outcome::Ok,
            _ => Outcome::Error,
        }
    }

    /// A request that got no answer: only a request that was never sent (no connection) or
    /// that timed out can be sent again; a body that fails to decode cannot.
    pub fn of_transport(e: &HttpError) -> Outcome {
        match e.kind() {
            HttpErrorKind::Connect | HttpErrorKind::Request => Outcome::Unavailable,
            HttpErrorKind::Timeout | HttpErrorKind::Interrupted => Outcome::Timeout,
            _ => Outcome::Error,
        }
    }

    /// The store pushed back: try again later, and slower.
    pub fn is_pushback(self) -> bool {
        matches!(
            self,
            Outcome::Throttled | Outcome::Unavailable | Outcome::Timeout
        )
    }

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Throttled => "throttled",
            Outcome::Unavailable => "unavailable",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
        }
    }
}

/// One request's retries: when it first failed, how often, and how long to wait next.
#[derive(Debug)]
pub struct Retries {
    timeout: Duration,
    /// At most this many retries too (the credentials probe's few); `None`: time alone.
    most: Option<u32>,
    first_failure: Option<Instant>,
    failures: u32,
    jitter: u64,
}

impl Retries {
    /// `timeout`: `store.retry_timeout`; zero: no retries at all.
    pub fn new(timeout: Duration) -> Retries {
        Retries {
            timeout,
            most: None,
            first_failure: None,
            failures: 0,
            jitter: seed(),
        }
    }

    /// Also at most `most` retries: for a probe that must answer quickly with the store's own
    /// words (the credentials check), never for a request a trainer waits for.
    pub fn at_most(mut self, most: u32) -> Retries {
        self.most = Some(most);
        self
    }

    /// Counts a failure (`outcome`, pushback or not); returns how long to wait before the
    /// next attempt, or `None` when there is none: the answer is final, or the store has
    /// pushed back for `store.retry_timeout` since the request first failed.
    pub fn failed(&mut self, outcome: Outcome) -> Option<Duration> {
        let first = *self.first_failure.get_or_insert_with(Instant::now);
        self.failures += 1;
        if !outcome.is_pushback()
            || first.elapsed() >= self.timeout
            || self.most.is_some_and(|most| self.failures > most)
        {
            return None;
        }
        let cap = FIRST_BACKOFF
            .saturating_mul(1 << (self.failures - 1).min(16))
            .min(MAX_BACKOFF);
        let wait = cap.mul_f64(self.uniform());
        // Never sleep past the deadline: the last attempt is made at it.
        Some(wait.min(self.timeout.saturating_sub(first.elapsed())))
    }

    /// Failures so far (the attempts, less the one that may still succeed).
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Time since the first failure.
    pub fn waited(&self) -> Duration {
        self.first_failure.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// A uniform draw in [0, 1): SplitMix64 (no generator crate for one random wait).
    fn uniform(&mut self) -> f64 {
        self.jitter = self.jitter.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.jitter;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A different seed per request: the clock's nanoseconds and a counter.
fn seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ NEXT.fetch_add(0x632b_e59b_d9b4_e019, Ordering::Relaxed)
}

/// A request the store kept pushing back for `store.retry_timeout`: what a stream that
/// needed it fails with, naming the cause and the time waited.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "the store {cause} for {waited:.1?} ({attempts} attempts; store.retry_timeout = {timeout:?})"
)]
pub struct GaveUp {
    /// What the last attempt met, in words: "answered 429 Too Many Requests (throttled)".
    pub cause: String,
    pub waited: Duration,
    pub attempts: u32,
    pub timeout: Duration,
}

impl GaveUp {
    /// Finds a `GaveUp` in an error's chain of sources.
    pub fn in_chain<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a GaveUp> {
        let mut next = Some(e);
        while let Some(e) = next {
            if let Some(gave_up) = e.downcast_ref::<GaveUp>() {
                return Some(gave_up);
            }
            next = e.source();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified_as_gcs_advises() {
        assert_eq!(Outcome::of_status(200), Outcome::Ok);
        assert_eq!(Outcome::of_status(206), Outcome::Ok);
        assert_eq!(Outcome::of_status(429), Outcome::Throttled);
        for s in [408, 500, 502, 503, 504] {
            assert_eq!(Outcome::of_status(s), Outcome::Unavailable, "{s}");
        }
        for s in [400, 401, 403, 404, 412] {
            assert_eq!(Outcome::of_status(s), Outcome::Error, "{s}");
            assert!(!Outcome::of_status(s).is_pushback());
        }
    }

    #[test]
    fn the_metrics_know_every_outcome() {
        let labels: Vec<&str> = Outcome::ALL.iter().map(|o| o.label()).collect();
        assert_eq!(labels, crate::ops::metrics::STORE_OUTCOMES);
    }

    #[test]
    fn backoff_is_jittered_below_a_doubling_cap_that_stops_at_the_maximum() {
        let mut r = Retries::new(Duration::from_secs(3600));
        let mut waits = Vec::new();
        for n in 0..40u32 {
            let w = r.failed(Outcome::Throttled).expect("within the timeout");
            let cap = FIRST_BACKOFF
                .saturating_mul(1 << n.min(16))
                .min(MAX_BACKOFF);
            assert!(w < cap, "failure {n}: {w:?} >= {cap:?}");
            waits.push(w);
        }
        // Full jitter: the waits at the cap spread over it (not all near the top or bottom).
        let late: Vec<f64> = waits[10..].iter().map(|w| w.as_secs_f64()).collect();
        let (lo, hi) = late
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), &w| (l.min(w), h.max(w)));
        assert!(lo < 3.0 && hi > 5.0, "waits at the cap: {late:?}");
        assert_eq!(r.failures(), 40);
    }

    #[test]
    fn a_final_answer_is_not_retried_and_the_time_bound_counts_from_the_first_failure() {
        let mut r = Retries::new(Duration::from_secs(60));
        assert_eq!(r.failed(Outcome::Error), None);
        let mut r = Retries::new(Duration::ZERO);
        assert_eq!(
            r.failed(Outcome::Unavailable),
            None,
            "retry_timeout 0: no retries"
        );
        // Many failures in little time are not a reason to stop: only the time is...
        let mut r = Retries::new(Duration::from_secs(60));
        for _ in 0..1000 {
            assert!(r.failed(Outcome::Timeout).is_some());
        }
        // ...but for a probe that asks for a few retries at most.
        let mut r = Retries::new(Duration::from_secs(60)).at_most(2);
        assert!(r.failed(Outcome::Unavailable).is_some());
        assert!(r.failed(Outcome::Unavailable).is_some());
        assert_eq!(r.failed(Outcome::Unavailable), None);
    }

    #[test]
    fn gave_up_is_found_under_the_errors_that_wrap_it() {
        let gave_up = GaveUp {
            cause: "answered 503 Service Unavailable".into(),
            waited: Duration::from_secs(3),
            attempts: 7,
            timeout: Duration::from_secs(3),
        };
        let wrapped = HttpError::new(HttpErrorKind::Unknown, gave_up);
        let found = GaveUp::in_chain(&wrapped).expect("in the chain");
        assert_eq!(found.attempts, 7);
        assert_eq!(
            found.to_string(),
            "the store answered 503 Service Unavailable for 3.0s (7 attempts; store.retry_timeout = 3s)"
        );
    }
}
