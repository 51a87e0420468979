//! This replica's own writes that its caches have not shown yet: the status
//! write of each InstanceGeneration, and the SwapAttempts it created.
//!
//! A cached InstanceGeneration still at the version our last status write
//! replaced is stale: planning from it could only lose the reservation race
//! against ourselves. The status write that reserves a revision and the create of its attempt
//! come back on two different watches, in either order. A reconcile woken by
//! the status event can find the attempt cache without the attempt it just
//! created, and a plan made then would issue the node a second attempt for
//! the same desired state. So each create is recorded here, and an
//! InstanceGeneration is not planned again until its cache shows every
//! attempt recorded for it — the expectations of Kubernetes' own ReplicaSet
//! controller, for the same reason.
//!
//! The same holds for the node records a plan writes onto attempts
//! (`genswap.dev/record`): a plan made before the cache shows one would
//! read the node's older record and announce its outcome a second time.
//!
//! And for deletes: an attempt this replica deleted stays in the cache
//! until the watch delivers its deletion, and a plan made before then lists
//! it again. Its second delete is a 404, harmless but a request: the fleet
//! bench's 5,000-node release sent 229 of them. So a deleted name is kept
//! here until the cache no longer shows it, and not sent again meanwhile.
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

/// Whether the caches have caught up with this replica's own writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaughtUp {
    /// They show every write (or there was none).
    Yes,
    /// The cached IG is still the version our status write replaced.
    StatusUnseen,
    /// These attempts are not in the cache yet.
    CreatesUnseen { missing: Vec<String> },
    /// These never showed up within [`PATIENCE`]; they are forgotten.
    GaveUp { missing: Vec<String> },
    /// These attempts do not show the record written onto them yet.
    RecordsUnseen { missing: Vec<String> },
}

#[derive(Debug, Default)]
struct Pending {
    /// The resourceVersion our last status write replaced.
    replaced: Option<String>,
    attempts: HashSet<String>,
    /// When the oldest of the attempts was created.
    since: Option<Instant>,
    /// Attempt name → the record annotation written onto it.
    records: HashMap<String, String>,
    /// When the oldest of the records was written.
    records_since: Option<Instant>,
}

/// Outstanding writes per InstanceGeneration.
#[derive(Debug)]
pub struct Expectations {
    patience: Duration,
    pending: Mutex<HashMap<IgKey, Pending>>,
    /// Attempts deleted that the cache may still show, by IG.
    deleted: Mutex<HashMap<IgKey, HashSet<String>>>,
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
            deleted: Mutex::new(HashMap::new()),
        }
    }

    /// Records that `attempt` of `ig` is deleted (or was already gone).
    pub fn deleted(&self, ig: &IgKey, attempt: &str) {
        self.deleted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(ig.clone())
            .or_default()
            .insert(attempt.to_string());
    }

    /// Those of `names` to delete: not the ones this replica deleted
    /// already. Forgets a deleted name once `cached` says the cache no
    /// longer holds it and the plan no longer lists it: a plan is made from
    /// a copy of the cache, and its deletes go out seconds later, after its
    /// creates, so the cache may have dropped a name the plan still lists.
    pub fn still_to_delete(
        &self,
        ig: &IgKey,
        names: &[String],
        cached: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut deleted = self.deleted.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(gone) = deleted.get_mut(ig) else {
            return names.to_vec();
        };
        gone.retain(|name| cached(name) || names.contains(name));
        let left = names
            .iter()
            .filter(|name| !gone.contains(name.as_str()))
            .cloned()
            .collect();
        if gone.is_empty() {
            deleted.remove(ig);
        }
        left
    }

    /// Records that our status write replaced `ig` at `version`.
    pub fn status_written(&self, ig: &IgKey, version: &str) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.entry(ig.clone()).or_default().replaced = Some(version.to_string());
    }

    /// Records that `attempt` of `ig` was created at `now`.
    pub fn created(&self, ig: &IgKey, attempt: &str, now: Instant) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = pending.entry(ig.clone()).or_default();
        entry.since.get_or_insert(now);
        entry.attempts.insert(attempt.to_string());
    }

    /// Records that `record` was written onto `attempt` of `ig` at `now`.
    pub fn record_written(&self, ig: &IgKey, attempt: &str, record: String, now: Instant) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = pending.entry(ig.clone()).or_default();
        entry.records_since.get_or_insert(now);
        entry.records.insert(attempt.to_string(), record);
    }

    /// Checks the records written for `ig` against the attempt cache:
    /// `shows(attempt, record)` says whether the cache shows that record on
    /// that attempt (or no longer holds the attempt). Forgets what it shows,
    /// and every record once the oldest is older than the patience: a plan
    /// from an older record announces an outcome twice, no worse.
    pub fn records_caught_up(
        &self,
        ig: &IgKey,
        shows: impl Fn(&str, &str) -> bool,
        now: Instant,
    ) -> CaughtUp {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(entry) = pending.get_mut(ig) else {
            return CaughtUp::Yes;
        };
        entry
            .records
            .retain(|attempt, record| !shows(attempt, record));
        let lapsed = entry
            .records_since
            .is_some_and(|since| now.saturating_duration_since(since) >= self.patience);
        if entry.records.is_empty() || lapsed {
            entry.records.clear();
            entry.records_since = None;
            if entry.replaced.is_none() && entry.attempts.is_empty() {
                pending.remove(ig);
            }
            return CaughtUp::Yes;
        }
        let mut missing: Vec<String> = entry.records.keys().cloned().collect();
        missing.sort();
        CaughtUp::RecordsUnseen { missing }
    }

    /// Checks the writes recorded for `ig` against the caches: the cached
    /// object's `version`, and `cached` saying whether an attempt of that
    /// name is in the attempt cache. Forgets what they show, and the creates
    /// once they are older than the patience.
    pub fn caught_up(
        &self,
        ig: &IgKey,
        version: Option<&str>,
        cached: impl Fn(&str) -> bool,
        now: Instant,
    ) -> CaughtUp {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(entry) = pending.get_mut(ig) else {
            return CaughtUp::Yes;
        };
        if entry.replaced.is_some() && entry.replaced.as_deref() == version {
            return CaughtUp::StatusUnseen;
        }
        entry.replaced = None;
        entry.attempts.retain(|attempt| !cached(attempt));
        if entry.attempts.is_empty() {
            entry.since = None;
            if entry.records.is_empty() {
                pending.remove(ig);
            }
            return CaughtUp::Yes;
        }
        let mut missing: Vec<String> = entry.attempts.iter().cloned().collect();
        missing.sort();
        let since = entry.since.unwrap_or(now);
        if now.saturating_duration_since(since) >= self.patience {
            entry.attempts.clear();
            entry.since = None;
            if entry.records.is_empty() {
                pending.remove(ig);
            }
            CaughtUp::GaveUp { missing }
        } else {
            CaughtUp::CreatesUnseen { missing }
        }
    }

    /// Forgets everything recorded for `ig`: it is being deleted. A replica
    /// that stops leading keeps what it recorded: its creates exist whoever
    /// leads, and if it leads again soon (a Lease renewal that failed under
    /// load), its attempt cache may still be behind them. Its follower
    /// reconciles call [`Expectations::caught_up`], which drops what the
    /// cache shows and what the patience ended.
    pub fn forget(&self, ig: &IgKey) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(ig);
        self.deleted
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
    fn a_deleted_attempt_is_not_deleted_again_while_the_cache_still_shows_it() {
        let expectations = Expectations::default();
        let names = vec!["web-a-1".to_string(), "web-b-2".to_string()];
        assert_eq!(
            expectations.still_to_delete(&web(), &names, |_| true),
            names
        );
        expectations.deleted(&web(), "web-a-1");
        assert_eq!(
            expectations.still_to_delete(&web(), &names, |_| true),
            ["web-b-2"],
            "the cache still shows web-a-1: a plan lists it again, it is not sent"
        );
        assert_eq!(
            expectations.still_to_delete(&web(), &names, |name| name != "web-a-1"),
            ["web-b-2"],
            "a plan made from a copy taken before the cache dropped it lists it: not sent"
        );
        let later = vec!["web-b-2".to_string()];
        assert_eq!(
            expectations.still_to_delete(&web(), &later, |name| name != "web-a-1"),
            later,
            "gone from the cache and from the plan: forgotten"
        );
        assert!(
            expectations
                .deleted
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty(),
            "nothing kept"
        );
    }

    #[test]
    fn an_ig_with_no_creates_is_caught_up() {
        let expectations = Expectations::default();
        assert_eq!(
            expectations.caught_up(&web(), None, |_| false, Instant::now()),
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
            expectations.caught_up(&web(), None, seen_n1, start),
            CaughtUp::CreatesUnseen {
                missing: vec!["web-n2-2".into()]
            }
        );
        // Another IG is not held by web's creates.
        assert_eq!(
            expectations.caught_up(&("apps".into(), "api".into()), None, |_| false, start),
            CaughtUp::Yes
        );
        let seen_n2 = |name: &str| name == "web-n2-2";
        assert_eq!(
            expectations.caught_up(&web(), None, seen_n2, start),
            CaughtUp::Yes
        );
        // Met expectations are forgotten: the attempt may be pruned later.
        assert_eq!(
            expectations.caught_up(&web(), None, |_| false, start),
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
            expectations.caught_up(&web(), None, |_| false, later),
            CaughtUp::CreatesUnseen { .. }
        ));
        let expired = start + Duration::from_secs(5);
        assert_eq!(
            expectations.caught_up(&web(), None, |_| false, expired),
            CaughtUp::GaveUp {
                missing: vec!["web-n1-1".into()]
            }
        );
        assert_eq!(
            expectations.caught_up(&web(), None, |_| false, expired),
            CaughtUp::Yes
        );
    }

    #[test]
    fn a_cached_object_at_the_version_our_status_write_replaced_is_stale() {
        let expectations = Expectations::default();
        let now = Instant::now();
        expectations.status_written(&web(), "100");
        expectations.created(&web(), "web-n1-5", now);
        assert_eq!(
            expectations.caught_up(&web(), Some("100"), |_| true, now),
            CaughtUp::StatusUnseen,
            "the attempt is there, but the object is the one we replaced"
        );
        assert_eq!(
            expectations.caught_up(&web(), Some("101"), |_| false, now),
            CaughtUp::CreatesUnseen {
                missing: vec!["web-n1-5".into()]
            }
        );
        assert_eq!(
            expectations.caught_up(&web(), Some("100"), |_| true, now),
            CaughtUp::Yes,
            "once the cache moved on, the old version is not held against it"
        );
    }

    #[test]
    fn waits_until_the_cache_shows_each_record_written() {
        let expectations = Expectations::with_patience(Duration::from_secs(5));
        let start = Instant::now();
        expectations.record_written(&web(), "web-n1-4", "r2".into(), start);
        expectations.record_written(&web(), "web-n2-5", "r3".into(), start);
        // The cache shows n1's older record, and n2's new one.
        let cache = |attempt: &str, record: &str| match attempt {
            "web-n1-4" => record == "r1",
            _ => record == "r3",
        };
        assert_eq!(
            expectations.records_caught_up(&web(), cache, start),
            CaughtUp::RecordsUnseen {
                missing: vec!["web-n1-4".into()]
            }
        );
        assert_eq!(
            expectations.caught_up(&web(), None, |_| true, start),
            CaughtUp::Yes,
            "creates and records are separate expectations"
        );
        assert_eq!(
            expectations.records_caught_up(&web(), |_, record| record == "r2", start),
            CaughtUp::Yes
        );
        // A record the cache never shows lapses with the patience.
        expectations.record_written(&web(), "web-n1-6", "r4".into(), start);
        assert!(matches!(
            expectations.records_caught_up(&web(), |_, _| false, start + Duration::from_secs(4)),
            CaughtUp::RecordsUnseen { .. }
        ));
        assert_eq!(
            expectations.records_caught_up(&web(), |_, _| false, start + Duration::from_secs(5)),
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
            expectations.caught_up(&web(), None, |_| false, now),
            CaughtUp::Yes
        );
        assert!(matches!(
            expectations.caught_up(&api, None, |_| false, now),
            CaughtUp::CreatesUnseen { .. }
        ));
    }
}
