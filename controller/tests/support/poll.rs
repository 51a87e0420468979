//! Waiting on a condition with a deadline, never a bare sleep. Its own file
//! so the benches that include `cluster.rs` get it without the rest of the
//! test support.

use std::time::Duration;

/// Polls `condition` every 20 ms until it holds; fails once `deadline` has
/// passed without it.
pub async fn poll_until(what: &str, deadline: Duration, mut condition: impl FnMut() -> bool) {
    let until = tokio::time::Instant::now() + deadline;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < until,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
