//! The bytes a stage fetches, counted as they arrive, for whoever watches
//! it (the agent's `status.stage` of a pre-staging attempt, its
//! `genswap_agent_stage_bytes_total`) and for [`crate::Staged::fetched`].
//!
//! The fetch paths (a URL's body, an image's layers) run inside the stage
//! call's own task, several calls deep; the counter travels with that task
//! ([`FetchProgress::scope`]) rather than through every signature between.
//! Bytes read from a path on the node are not fetched and are not counted.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

tokio::task_local! {
    static CURRENT: FetchProgress;
}

/// Counts shared between a stage and its watchers. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct FetchProgress {
    counts: Arc<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    fetched: AtomicU64,
    /// What the sources said they will send (Content-Length, layer sizes).
    expected: AtomicU64,
}

impl FetchProgress {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes received so far.
    pub fn fetched(&self) -> u64 {
        self.counts.fetched.load(Ordering::Relaxed)
    }

    /// Bytes the fetch needs in all, once a source has said.
    pub fn total(&self) -> Option<u64> {
        Some(self.counts.expected.load(Ordering::Relaxed)).filter(|total| *total > 0)
    }

    /// Runs `work` with this counter as the one its fetches add to.
    pub(crate) async fn scope<F: Future>(&self, work: F) -> F::Output {
        CURRENT.scope(self.clone(), work).await
    }
}

/// Adds `bytes` received to the stage's counter, if one watches.
pub(crate) fn fetched(bytes: usize) {
    let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
    let _ = CURRENT.try_with(|progress| {
        progress.counts.fetched.fetch_add(bytes, Ordering::Relaxed);
    });
}

/// Adds what a source announced it will send.
pub(crate) fn expect(bytes: u64) {
    let _ = CURRENT.try_with(|progress| {
        progress.counts.expected.fetch_add(bytes, Ordering::Relaxed);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn counts_what_its_own_task_fetches_and_nothing_outside() {
        let progress = FetchProgress::new();
        fetched(5);
        progress
            .scope(async {
                expect(10);
                fetched(3);
                fetched(4);
            })
            .await;
        fetched(100);
        assert_eq!(progress.fetched(), 7);
        assert_eq!(progress.total(), Some(10));
        assert_eq!(FetchProgress::new().total(), None);
    }
}
