//! Which watch caches have finished their first list.
//!
//! A plan made before the SwapAttempt or Node cache has filled would see no
//! attempts and no nodes, and issue every node an attempt it already has.
//! kube-runtime holds reconciles only until the InstanceGeneration cache is
//! ready, so the reconciler waits for the other two here.
//!
//! This is tracked from the watch streams (their first `InitDone`, after the
//! reflector upstream applied it) rather than with `Store::wait_until_ready`:
//! that future keeps a single waker per store, so of two tasks waiting on
//! the same store only the last one to poll is woken.

use std::future::Future;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::runtime::watcher;
use tokio::sync::watch;

/// One of the caches a plan reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cache {
    InstanceGenerations,
    SwapAttempts,
    Nodes,
}

impl Cache {
    const ALL: [Cache; 3] = [
        Cache::InstanceGenerations,
        Cache::SwapAttempts,
        Cache::Nodes,
    ];

    fn bit(self) -> u8 {
        match self {
            Cache::InstanceGenerations => 1,
            Cache::SwapAttempts => 2,
            Cache::Nodes => 4,
        }
    }
}

const ALL_SYNCED: u8 = 1 | 2 | 4;

/// The sync state of the three caches, shared by the watch streams that set
/// it and everyone who waits for it.
#[derive(Clone, Debug)]
pub struct CacheSync(Arc<watch::Sender<u8>>);

impl Default for CacheSync {
    fn default() -> Self {
        Self::new()
    }
}

impl CacheSync {
    /// No cache synced yet.
    pub fn new() -> Self {
        Self(Arc::new(watch::Sender::new(0)))
    }

    /// Every cache marked synced: for callers that fill the caches
    /// themselves.
    pub fn all_marked() -> Self {
        let sync = Self::new();
        for cache in Cache::ALL {
            sync.mark(cache);
        }
        sync
    }

    /// Records that `cache` has been filled by its first list.
    pub fn mark(&self, cache: Cache) {
        self.0.send_if_modified(|synced| {
            let before = *synced;
            *synced |= cache.bit();
            *synced != before
        });
    }

    /// Whether `cache` has synced.
    pub fn is_synced(&self, cache: Cache) -> bool {
        *self.0.borrow() & cache.bit() != 0
    }

    /// Whether every cache has synced.
    pub fn all_synced(&self) -> bool {
        *self.0.borrow() == ALL_SYNCED
    }

    /// Resolves once every cache has synced; any number of tasks may wait.
    pub fn wait_all(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut receiver = self.0.subscribe();
        async move {
            // An error means the sender is gone, which cannot happen while
            // `self` lives; either way there is nothing more to wait for.
            let _ = receiver.wait_for(|synced| *synced == ALL_SYNCED).await;
        }
    }

    /// Passes a reflected watch stream through, marking `cache` synced at
    /// its first `InitDone`. Place it after `.reflect(..)`, so the store
    /// already holds the list when the mark is made.
    pub fn track<K, S>(
        &self,
        cache: Cache,
        events: S,
    ) -> impl Stream<Item = S::Item> + Send + use<K, S>
    where
        S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
    {
        let sync = self.clone();
        events.inspect(move |event| {
            if let Ok(watcher::Event::InitDone) = event {
                sync.mark(cache);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn synced_only_when_all_three_are() {
        let sync = CacheSync::new();
        sync.mark(Cache::InstanceGenerations);
        sync.mark(Cache::Nodes);
        assert!(sync.is_synced(Cache::Nodes));
        assert!(!sync.is_synced(Cache::SwapAttempts));
        assert!(!sync.all_synced());
        sync.mark(Cache::SwapAttempts);
        assert!(sync.all_synced());
        assert!(CacheSync::all_marked().all_synced());
    }

    #[tokio::test]
    async fn every_waiter_is_woken() {
        let sync = CacheSync::new();
        let waiters: Vec<_> = (0..3).map(|_| tokio::spawn(sync.wait_all())).collect();
        tokio::task::yield_now().await;
        for cache in Cache::ALL {
            sync.mark(cache);
        }
        for waiter in waiters {
            tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .expect("woken once all caches synced")
                .expect("waiter task ran");
        }
    }

    #[tokio::test]
    async fn the_first_init_done_marks_the_cache() {
        let sync = CacheSync::new();
        let events = futures::stream::iter([
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(1u8)),
            Err(watcher::Error::NoResourceVersion),
        ]);
        let seen: Vec<_> = sync.track(Cache::Nodes, events).collect().await;
        assert_eq!(seen.len(), 3, "every event passes through");
        assert!(!sync.is_synced(Cache::Nodes), "no InitDone yet");

        let events = futures::stream::iter([Ok(watcher::Event::<u8>::InitDone)]);
        let _: Vec<_> = sync.track(Cache::Nodes, events).collect().await;
        assert!(sync.is_synced(Cache::Nodes));
        assert!(!sync.is_synced(Cache::SwapAttempts));
    }
}
