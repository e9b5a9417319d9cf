//! A host's request rate to one bucket, adapted to what the bucket allows.
//!
//! A pod's hosts share one bucket, which answers 429 past its request rate (GCS: about 5,000
//! object reads per second for a new bucket, more after a ramp-up). Each host paces its
//! requests with a token bucket whose rate follows the bucket's answers, as CUBIC's window
//! follows a network's losses (the AWS SDKs' adaptive retry mode does the same for rates):
//!
//! - **No limit** until the first 429 (or `store.max_requests_per_second`, a ceiling the
//!   operator gives each host). A bucket that never throttles costs nothing.
//! - **A 429** sets the rate to [`DECREASE`] × the rate the host was sending at, and that
//!   rate is remembered as the last good one. At most once per [`COOLDOWN`], and never for
//!   a 429 to a request sent before the last cut: while the other hosts of the pod are still
//!   bursting, the 429s of one second are one signal, not many (cut once per 429, a host fell
//!   to a tenth of its share in a second, and took a minute to climb back).
//! - **Then the rate climbs back** while the limit holds requests back, along a cubic of the
//!   time since the cut: quickly at first, level near the last good rate ([`RECOVER`] after
//!   the cut), then faster and faster past it, to find what the hosts that finished left.
//!   It never runs ahead of twice what the host sends: an idle host's limit does not grow.
//!   The rate never falls below [`MIN_RATE`].
//! - **503s and timeouts** do not lower the rate: an outage is not a rate, and a rate cut to
//!   the floor during one would take minutes to climb back. Each request backs off on its own
//!   instead ([`super::retry`]), and its retries pass through this pacer like any request.
//!
//! **Priorities.** A request a trainer is waiting for ([`Urgency`]) takes the next token
//! before every prefetch, in arrival order; prefetches take only what is left. A prefetch
//! that a trainer comes to wait for is raised in place ([`Urgency::raise`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::retry::Outcome;
// tokio's clock: the tests pause it.
use tokio::time::Instant;

/// The rate after a 429, as a share of the rate sent at (CUBIC's β).
pub const DECREASE: f64 = 0.7;
/// The lowest rate, requests per second: a throttled host still asks now and then.
pub const MIN_RATE: f64 = 0.5;
/// At most one cut per this long.
pub const COOLDOWN: Duration = Duration::from_secs(1);
/// How long after a cut the rate is back at the last good rate (CUBIC's K).
pub const RECOVER: Duration = Duration::from_secs(1);
/// Tokens a bucket holds at most, in seconds of its rate (and at least one token).
const BURST: f64 = 0.1;
/// A limit counts as holding requests back for this long after it last made one wait.
const LIMITED_FOR: Duration = Duration::from_secs(1);
/// How often a request that waits for another's turn looks again, in case the turn moved
/// without a wake-up (a raised urgency).
const RECHECK: Duration = Duration::from_millis(10);
/// The time constant of the measured send rate.
const RATE_WINDOW: f64 = 1.0;

tokio::task_local! {
    /// The urgency of the requests a task makes: set around a cache load.
    pub static URGENCY: Urgency;
}

/// Whether a trainer waits for a request (urgent) or it reads ahead (a prefetch). Shared by
/// a load's requests, so that raising it raises those already waiting for a token.
#[derive(Debug, Clone, Default)]
pub struct Urgency(Arc<AtomicBool>);

impl Urgency {
    pub fn urgent() -> Urgency {
        Urgency(Arc::new(AtomicBool::new(true)))
    }

    pub fn prefetch() -> Urgency {
        Urgency::default()
    }

    /// A trainer now waits for it.
    pub fn raise(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_urgent(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// The urgency of the current task's requests: urgent unless a load said otherwise
    /// (a request outside a load, a manifest or a check, is someone's wait).
    pub fn current() -> Urgency {
        URGENCY
            .try_with(Urgency::clone)
            .unwrap_or_else(|_| Urgency::urgent())
    }
}

/// One bucket's pacer, shared by every request of the host to it.
pub struct Pacer {
    state: Mutex<State>,
    turn: Notify,
    ceiling: Option<f64>,
}

struct State {
    /// Requests per second; `None`: no limit (yet).
    rate: Option<f64>,
    /// The rate the host sent at when it was last cut: where the climb levels off.
    last_good: f64,
    tokens: f64,
    refilled: Instant,
    last_decrease: Option<Instant>,
    last_limited: Option<Instant>,
    /// The last time the store pushed back, and how.
    last_pushback: Option<(Instant, Outcome)>,
    /// The rate requests were sent at, decayed over `RATE_WINDOW`.
    sent_rate: f64,
    sent_at: Instant,
    /// Requests waiting for a token, in arrival order.
    queue: VecDeque<(u64, Urgency)>,
    next_id: u64,
}

/// What the pacer's state is, for metrics and `/status`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Snapshot {
    /// Requests per second; `None`: no limit.
    pub rate: Option<f64>,
    pub waiting: usize,
    pub urgent_waiting: usize,
    /// How the store last pushed back, and how long ago.
    pub last_pushback: Option<(Outcome, Duration)>,
}

impl Pacer {
    /// `ceiling`: `store.max_requests_per_second`, if set.
    pub fn new(ceiling: Option<f64>) -> Pacer {
        let now = Instant::now();
        Pacer {
            state: Mutex::new(State {
                rate: ceiling,
                last_good: ceiling.unwrap_or(MIN_RATE),
                tokens: 1.0,
                refilled: now,
                last_decrease: None,
                last_limited: None,
                last_pushback: None,
                sent_rate: 0.0,
                sent_at: now,
                queue: VecDeque::new(),
                next_id: 0,
            }),
            turn: Notify::new(),
            ceiling,
        }
    }

    /// Waits for a token: immediately while there is no limit, else in turn (urgent
    /// requests first). Returns how long it waited.
    pub async fn acquire(&self, urgency: &Urgency) -> Duration {
        let asked = Instant::now();
        let id = {
            let mut st = self.state.lock().unwrap();
            st.count_sent(asked);
            if st.rate.is_none() {
                return Duration::ZERO;
            }
            let id = st.next_id;
            st.next_id += 1;
            st.queue.push_back((id, urgency.clone()));
            id
        };
        // Leaves the queue however the wait ends (a dropped request too).
        let _leave = Leave { pacer: self, id };
        loop {
            let turn = self.turn.notified();
            tokio::pin!(turn);
            turn.as_mut().enable();
            let wait = {
                let mut st = self.state.lock().unwrap();
                let now = Instant::now();
                st.refill(now);
                let Some(rate) = st.rate else {
                    return asked.elapsed(); // the limit was lifted
                };
                if st.tokens >= 1.0 && st.next_in_turn() == Some(id) {
                    st.tokens -= 1.0;
                    if now > asked {
                        st.last_limited = Some(now);
                    }
                    self.turn.notify_waiters();
                    return asked.elapsed();
                }
                // A token is there but another request's turn: it takes it and wakes the rest.
                // Never without a timer, though: a request raised while it waits
                // (`Urgency::raise`) becomes the one in turn without anyone being woken, and
                // every request waiting for a wake-up alone would wait for ever (the soak hung
                // so).
                if st.tokens < 1.0 {
                    Duration::from_secs_f64((1.0 - st.tokens) / rate)
                } else {
                    RECHECK
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = &mut turn => {}
            }
        }
    }

    /// Adapts the rate to how a request sent at `sent` ended.
    pub fn record(&self, outcome: Outcome, sent: Instant) {
        let mut st = self.state.lock().unwrap();
        let now = Instant::now();
        if outcome.is_pushback() {
            st.last_pushback = Some((now, outcome));
        }
        match outcome {
            Outcome::Throttled => {
                let cut_lately = st
                    .last_decrease
                    .is_some_and(|at| sent < at || now.duration_since(at) < COOLDOWN);
                if cut_lately {
                    return; // the same signal as the last cut's
                }
                // From the rate it sent at, if below its limit (a limit it does not use
                // says nothing about what the bucket allows).
                let sent_rate = st.sent_rate(now);
                let from = st.rate.unwrap_or(sent_rate).min(sent_rate.max(MIN_RATE));
                // Cut again before it was back: the bucket allows less than last time.
                st.last_good = if from < st.last_good && st.last_decrease.is_some() {
                    from * (1.0 + DECREASE) / 2.0
                } else {
                    from
                };
                let rate = (from * DECREASE).max(MIN_RATE);
                st.rate = Some(self.ceiling.map_or(rate, |c| rate.min(c)));
                st.tokens = st.tokens.min(1.0);
                st.last_decrease = Some(now);
            }
            Outcome::Ok => {
                let (Some(rate), Some(cut)) = (st.rate, st.last_decrease) else {
                    return; // no limit, or the ceiling alone
                };
                if st
                    .last_limited
                    .is_none_or(|at| now.duration_since(at) >= LIMITED_FOR)
                {
                    return; // the limit holds nothing back: no reason to raise it
                }
                let t = now.duration_since(cut).as_secs_f64() / RECOVER.as_secs_f64();
                let cubic = st.last_good * (1.0 + (1.0 - DECREASE) * (t - 1.0).powi(3));
                let most = 2.0 * st.sent_rate(now) + 1.0;
                let raised = cubic.min(most).max(rate.min(most)).max(MIN_RATE);
                st.rate = Some(self.ceiling.map_or(raised, |c| raised.min(c)));
            }
            _ => {}
        }
        drop(st);
        self.turn.notify_waiters();
    }

    pub fn snapshot(&self) -> Snapshot {
        let st = self.state.lock().unwrap();
        Snapshot {
            rate: st.rate,
            waiting: st.queue.len(),
            urgent_waiting: st.queue.iter().filter(|(_, u)| u.is_urgent()).count(),
            last_pushback: st.last_pushback.map(|(at, how)| (how, at.elapsed())),
        }
    }
}

impl State {
    fn refill(&mut self, now: Instant) {
        if let Some(rate) = self.rate {
            let burst = (rate * BURST).max(1.0);
            let gained = now.duration_since(self.refilled).as_secs_f64() * rate;
            self.tokens = (self.tokens + gained).min(burst);
        }
        self.refilled = now;
    }

    /// The first urgent request waiting, else the first waiting.
    fn next_in_turn(&self) -> Option<u64> {
        self.queue
            .iter()
            .find(|(_, u)| u.is_urgent())
            .or(self.queue.front())
            .map(|(id, _)| *id)
    }

    /// Counts a request sent now into the decayed send rate.
    fn count_sent(&mut self, now: Instant) {
        self.decay(now);
        self.sent_rate += 1.0 / RATE_WINDOW;
    }

    /// The rate requests were sent at lately: the count of about the last second. (Not
    /// extrapolated from a shorter history: a pod's first burst, 20 requests in 50 ms, is
    /// no rate of 400 a second.)
    fn sent_rate(&mut self, now: Instant) -> f64 {
        self.decay(now);
        self.sent_rate
    }

    /// Brings the send rate to `now` (no request since it was last counted).
    fn decay(&mut self, now: Instant) {
        let dt = now.duration_since(self.sent_at).as_secs_f64();
        self.sent_rate *= (-dt / RATE_WINDOW).exp();
        self.sent_at = now;
    }
}

struct Leave<'a> {
    pacer: &'a Pacer,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let mut st = self.pacer.state.lock().unwrap();
        st.queue.retain(|(id, _)| *id != self.id);
        drop(st);
        self.pacer.turn.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `n` requests, `every` apart.
    async fn send(pacer: &Pacer, n: usize, every: Duration) {
        for _ in 0..n {
            pacer.acquire(&Urgency::prefetch()).await;
            tokio::time::sleep(every).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn no_limit_until_the_first_429_then_the_rate_sent_at_times_the_decrease() {
        let pacer = Pacer::new(None);
        // 50 requests a second for three seconds, none held back.
        send(&pacer, 150, Duration::from_millis(20)).await;
        assert_eq!(pacer.snapshot().rate, None);
        pacer.record(Outcome::Throttled, Instant::now());
        let rate = pacer.snapshot().rate.expect("limited");
        // The rate of about the last second (47.5: the count decays over a second).
        assert!((rate - 50.0 * DECREASE).abs() < 2.5, "{rate}");
        // 429s to requests sent before the cut, or within COOLDOWN of it, are the same
        // signal: no second cut...
        pacer.record(
            Outcome::Throttled,
            Instant::now() - Duration::from_millis(5),
        );
        tokio::time::sleep(COOLDOWN / 2).await;
        pacer.record(Outcome::Throttled, Instant::now());
        assert_eq!(pacer.snapshot().rate, Some(rate));
        // ...one COOLDOWN later, a 429 cuts again.
        tokio::time::sleep(COOLDOWN).await;
        pacer.record(Outcome::Throttled, Instant::now());
        assert!(pacer.snapshot().rate.unwrap() < rate);
        // Outages and timeouts leave the rate alone.
        let now = pacer.snapshot().rate;
        pacer.record(Outcome::Unavailable, Instant::now());
        pacer.record(Outcome::Timeout, Instant::now());
        assert_eq!(pacer.snapshot().rate, now);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_are_paced_at_the_rate() {
        let pacer = Pacer::new(Some(10.0));
        let start = Instant::now();
        for _ in 0..31 {
            pacer.acquire(&Urgency::urgent()).await;
        }
        // One token to start with, then one per 100 ms.
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(2990) && took < Duration::from_millis(3100),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_pods_first_burst_is_not_taken_for_a_rate() {
        let pacer = Pacer::new(None);
        // 20 requests at once, the first 429 50 ms later: a rate of 20 a second at most.
        send(&pacer, 20, Duration::ZERO).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        pacer.record(Outcome::Throttled, Instant::now());
        let rate = pacer.snapshot().rate.unwrap();
        assert!(rate <= 20.0 * DECREASE, "{rate}");
    }

    /// Sends as fast as the limit lets for `time`, every request a success.
    async fn succeed(pacer: &Pacer, time: Duration) {
        let t = Instant::now();
        while t.elapsed() < time {
            pacer.acquire(&Urgency::urgent()).await;
            pacer.record(Outcome::Ok, Instant::now());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_cut_the_rate_is_back_in_seconds_then_probes_past_it_up_to_the_ceiling() {
        let pacer = Pacer::new(Some(200.0));
        succeed(&pacer, Duration::from_secs(3)).await;
        pacer.record(Outcome::Throttled, Instant::now());
        let cut = pacer.snapshot().rate.unwrap();
        let good = cut / DECREASE;
        assert!(good > 180.0, "cut from {good}");
        // Half way to RECOVER: most of the way back.
        succeed(&pacer, RECOVER / 2).await;
        let half = pacer.snapshot().rate.unwrap();
        assert!(
            half > cut + 0.8 * (good - cut) && half < good,
            "{cut} -> {half}"
        );
        // At RECOVER: level, at the last good rate.
        succeed(&pacer, RECOVER / 2).await;
        let back = pacer.snapshot().rate.unwrap();
        assert!((back - good).abs() < 0.02 * good, "{good} -> {back}");
        // Past it, faster and faster, but never past the ceiling.
        succeed(&pacer, RECOVER * 2).await;
        assert_eq!(pacer.snapshot().rate, Some(200.0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cut_before_the_rate_is_back_remembers_less() {
        let pacer = Pacer::new(None);
        succeed(&pacer, Duration::ZERO).await;
        send(&pacer, 300, Duration::from_millis(10)).await; // 100 a second
        pacer.record(Outcome::Throttled, Instant::now());
        succeed(&pacer, COOLDOWN).await; // part of the way back
        let climbed = pacer.snapshot().rate.unwrap();
        pacer.record(Outcome::Throttled, Instant::now());
        // The bucket allows less than last time: the climb levels off below where it came from.
        succeed(&pacer, RECOVER).await;
        let level = pacer.snapshot().rate.unwrap();
        assert!(level < climbed, "{climbed} -> {level}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_limit_that_holds_nothing_back_is_not_raised() {
        let pacer = Pacer::new(Some(10.0));
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert_eq!(pacer.acquire(&Urgency::urgent()).await, Duration::ZERO);
            pacer.record(Outcome::Ok, Instant::now());
        }
        assert_eq!(pacer.snapshot().rate, Some(10.0));
    }

    #[tokio::test(start_paused = true)]
    async fn urgent_requests_go_before_every_prefetch_and_a_raised_prefetch_goes_with_them() {
        let pacer = Arc::new(Pacer::new(Some(1.0)));
        pacer.acquire(&Urgency::urgent()).await; // the bucket is empty now
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        let raised = Urgency::prefetch();
        let urgencies = [
            ("p0", Urgency::prefetch()),
            ("p1", raised.clone()),
            ("p2", Urgency::prefetch()),
            ("u0", Urgency::urgent()),
            ("u1", Urgency::urgent()),
        ];
        for (name, urgency) in urgencies {
            let (pacer, order) = (pacer.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                pacer.acquire(&urgency).await;
                order.lock().unwrap().push(name);
            }));
            tokio::task::yield_now().await; // queued in this order
        }
        assert_eq!(pacer.snapshot().waiting, 5);
        assert_eq!(pacer.snapshot().urgent_waiting, 2);
        raised.raise();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["p1", "u0", "u1", "p0", "p2"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_stops_waiting_leaves_its_place() {
        let pacer = Arc::new(Pacer::new(Some(1.0)));
        pacer.acquire(&Urgency::urgent()).await;
        let waiting = {
            let pacer = pacer.clone();
            tokio::spawn(async move { pacer.acquire(&Urgency::urgent()).await })
        };
        tokio::task::yield_now().await;
        assert_eq!(pacer.snapshot().waiting, 1);
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(pacer.snapshot().waiting, 0);
        // The token it would have had goes to the next one.
        let t = Instant::now();
        pacer.acquire(&Urgency::prefetch()).await;
        assert!(t.elapsed() <= Duration::from_secs(1));
    }
}
