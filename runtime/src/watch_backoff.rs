//! How a watch reconnects after the API server failed it.
//!
//! kube-runtime's default backs off to 30 s (plus up to 30 s of jitter), so
//! after a long outage a watch could stay closed for a minute after the API
//! server was ready again, and nothing converged meanwhile. Every watch of
//! the controller and the agent reconnects with this one instead: it still
//! doubles (a down server is not hammered: at most one try per watch every
//! [`CEILING`]) and is jittered (replicas and agents do not reconnect in
//! step), but no sleep is longer than twice [`CEILING`].
//!
//! One failure is no reason to wait: `410 Gone` ("too old resource
//! version", what every watch meets once an API server restarted). The
//! watcher has already dropped its resource version and relists on its
//! next poll; a sleep first only delays convergence (3 s of 4.9 after an
//! outage, measured on a real server). [`reconnecting`] lets that one
//! through at once.

use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, ExponentialBackoff};

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

/// `stream` (a `watcher`) reconnecting with [`watch_backoff`] after a
/// failure, but relisting at once after `410 Gone`.
pub fn reconnecting<K: Send>(
    stream: impl Stream<Item = watcher::Result<watcher::Event<K>>> + Send,
) -> impl Stream<Item = watcher::Result<watcher::Event<K>>> + Send {
    stream
        .filter(|item| {
            let gone = is_gone(item);
            if gone {
                tracing::debug!("the watch's resource version expired (410 Gone); relisting");
            }
            std::future::ready(!gone)
        })
        .backoff(watch_backoff())
}

fn is_gone<K>(item: &watcher::Result<watcher::Event<K>>) -> bool {
    matches!(item, Err(watcher::Error::WatchError(status)) if status.code == 410)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    fn failed(code: u16) -> watcher::Result<watcher::Event<()>> {
        let status = Status::failure("expired", "Expired").with_code(code);
        Err(watcher::Error::WatchError(Box::new(status)))
    }

    /// The (paused, self-advancing) time `reconnecting` takes to pass on
    /// the event that follows `item`.
    async fn delay_after(item: watcher::Result<watcher::Event<()>>) -> Duration {
        let items = futures::stream::iter([item, Ok(watcher::Event::InitDone)]);
        let start = tokio::time::Instant::now();
        let mut stream = Box::pin(reconnecting(items));
        while let Some(item) = stream.next().await {
            if matches!(item, Ok(watcher::Event::InitDone)) {
                break;
            }
        }
        start.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn gone_relists_at_once_and_other_failures_back_off() {
        assert_eq!(delay_after(failed(410)).await, Duration::ZERO);
        assert!(delay_after(failed(500)).await >= FIRST);
    }

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
