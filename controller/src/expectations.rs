//! The SwapAttempts this replica created that its cache has not shown yet.
//!
//! The status write that reserves a revision and the create of its attempt
//! come back on two different watches, in either order. A reconcile woken by
//! the status event can find the attempt cache without the attempt it just
//! created, and a plan made then would issue the node a second attempt for
//! the same desired state. So each create is recorded here, and an
//! InstanceGeneration is not planned again until its cache shows every
//! attempt recorded for it — the expectations of Kubernetes' own ReplicaSet
//! controller, for the same reason.
//!
//! An expectation that the cache never meets (the attempt was deleted before
//! the watch delivered it, or the watch is stuck) lapses after a patience, so
//! one lost event cannot stop an InstanceGeneration for good.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long an InstanceGeneration waits for its cache to show an attempt it
/// created before it is planned anyway. A watch normally delivers within
/// milliseconds; Kubernetes' controllers wait up to five minutes.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// An InstanceGeneration: (namespace, name).
pub type IgKey = (String, String);

/// Whether the cache has caught up with this replica's own creates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaughtUp {
    /// Every attempt created for the IG is in the cache (or none was).
    Yes,
    /// These attempts are not in the cache yet.
    Waiting { missing: Vec<String> },
    /// These never showed up within [`PATIENCE`]; they are forgotten.
    GaveUp { missing: Vec<String> },
}

#[derive(Debug)]
struct Pending {
    attempts: HashSet<String>,
    /// When the oldest of them was created.
    since: Instant,
}

/// Outstanding creates per InstanceGeneration.
#[derive(Debug)]
pub struct Expectations {
    patience: Duration,
    pending: Mutex<HashMap<IgKey, Pending>>,
}

impl Default for Expectations {
    fn default() -> Self {
        Self::with_patience(PATIENCE)
    }
}

impl Expectations {
    pub fn with_patience(patience: Duration) -> Self {
        Self {
            patience,
            pending: Mutex::new(HashMap::new()),
        }
    }

    /// Records that `attempt` of `ig` was created at `now`.
    pub fn created(&self, ig: &IgKey, attempt: &str, now: Instant) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending
            .entry(ig.clone())
            .or_insert_with(|| Pending {
                attempts: HashSet::new(),
                since: now,
            })
            .attempts
            .insert(attempt.to_string());
    }

    /// Checks the outstanding creates of `ig` against the cache (`cached`
    /// says whether an attempt of that name is in it) and forgets those it
    /// has shown, or all of them once they are older than the patience.
    pub fn caught_up(&self, ig: &IgKey, cached: impl Fn(&str) -> bool, now: Instant) -> CaughtUp {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(entry) = pending.get_mut(ig) else {
            return CaughtUp::Yes;
        };
        entry.attempts.retain(|attempt| !cached(attempt));
        if entry.attempts.is_empty() {
            pending.remove(ig);
            return CaughtUp::Yes;
        }
        let mut missing: Vec<String> = entry.attempts.iter().cloned().collect();
        missing.sort();
        if now.saturating_duration_since(entry.since) >= self.patience {
            pending.remove(ig);
            CaughtUp::GaveUp { missing }
        } else {
            CaughtUp::Waiting { missing }
        }
    }

    /// Forgets everything recorded for `ig`: it is being deleted, or this
    /// replica no longer leads and will plan from the API server's state
    /// when it leads again.
    pub fn forget(&self, ig: &IgKey) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(ig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> IgKey {
        ("apps".into(), "web".into())
    }

    #[test]
    fn an_ig_with_no_creates_is_caught_up() {
        let expectations = Expectations::default();
        assert_eq!(
            expectations.caught_up(&web(), |_| false, Instant::now()),
            CaughtUp::Yes
        );
    }

    #[test]
    fn waits_until_the_cache_shows_every_create() {
        let expectations = Expectations::default();
        let start = Instant::now();
        expectations.created(&web(), "web-n1-1", start);
        expectations.created(&web(), "web-n2-2", start);

        let seen_n1 = |name: &str| name == "web-n1-1";
        assert_eq!(
            expectations.caught_up(&web(), seen_n1, start),
            CaughtUp::Waiting {
                missing: vec!["web-n2-2".into()]
            }
        );
        // Another IG is not held by web's creates.
        assert_eq!(
            expectations.caught_up(&("apps".into(), "api".into()), |_| false, start),
            CaughtUp::Yes
        );
        let seen_n2 = |name: &str| name == "web-n2-2";
        assert_eq!(
            expectations.caught_up(&web(), seen_n2, start),
            CaughtUp::Yes
        );
        // Met expectations are forgotten: the attempt may be pruned later.
        assert_eq!(
            expectations.caught_up(&web(), |_| false, start),
            CaughtUp::Yes
        );
    }

    #[test]
    fn gives_up_after_the_patience_and_forgets() {
        let expectations = Expectations::with_patience(Duration::from_secs(5));
        let start = Instant::now();
        expectations.created(&web(), "web-n1-1", start);
        let later = start + Duration::from_secs(4);
        assert!(matches!(
            expectations.caught_up(&web(), |_| false, later),
            CaughtUp::Waiting { .. }
        ));
        let expired = start + Duration::from_secs(5);
        assert_eq!(
            expectations.caught_up(&web(), |_| false, expired),
            CaughtUp::GaveUp {
                missing: vec!["web-n1-1".into()]
            }
        );
        assert_eq!(
            expectations.caught_up(&web(), |_| false, expired),
            CaughtUp::Yes
        );
    }

    #[test]
    fn forget_drops_what_was_recorded_for_one_ig() {
        let expectations = Expectations::default();
        let now = Instant::now();
        let api: IgKey = ("apps".into(), "api".into());
        expectations.created(&web(), "web-n1-1", now);
        expectations.created(&api, "api-n1-1", now);
        expectations.forget(&web());
        assert_eq!(
            expectations.caught_up(&web(), |_| false, now),
            CaughtUp::Yes
        );
        assert!(matches!(
            expectations.caught_up(&api, |_| false, now),
            CaughtUp::Waiting { .. }
        ));
    }
}
