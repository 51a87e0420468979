//! How a watch reconnects after the API server failed it.
//!
//! kube-runtime's default backs off to 30 s (plus up to 30 s of jitter), so
//! after a long outage a watch could stay closed for a minute after the API
//! server was ready again, and nothing converged meanwhile. Every watch of
//! the controller and the agent reconnects with this one instead: it still
//! doubles (a down server is not hammered: at most one try per watch every
//! [`CEILING`]) and is jittered (replicas and agents do not reconnect in
//! step), but no sleep is longer than twice [`CEILING`].

use std::time::Duration;

use kube::runtime::utils::Backoff;
use kube::runtime::watcher::ExponentialBackoff;

/// The first sleep after a failure, before jitter.
pub const FIRST: Duration = Duration::from_millis(500);
/// The longest sleep before jitter; jitter adds up to as much again.
pub const CEILING: Duration = Duration::from_millis(2500);

/// The backoff for one watch stream; it resets on the stream's next event.
pub fn watch_backoff() -> impl Backoff {
    ExponentialBackoff::from(
        backon::ExponentialBuilder::default()
            .with_min_delay(FIRST)
            .with_max_delay(CEILING)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleeps_grow_from_the_first_and_never_pass_twice_the_ceiling() {
        let delays: Vec<Duration> = watch_backoff().take(200).collect();
        assert_eq!(delays.len(), 200, "a watch retries for ever");
        assert!(delays[0] >= FIRST && delays[0] <= FIRST * 2, "{delays:?}");
        assert!(delays.iter().all(|d| *d <= CEILING * 2), "{delays:?}");
        // Past the doubling, every sleep is at least the ceiling.
        assert!(delays[10..].iter().all(|d| *d >= CEILING), "{delays:?}");
    }

    #[test]
    fn a_reset_starts_again_from_the_first_sleep() {
        let mut backoff = watch_backoff();
        for _ in 0..20 {
            backoff.next();
        }
        backoff.reset();
        let first = backoff.next().expect("a sleep");
        assert!(first <= FIRST * 2, "{first:?}");
    }
}
