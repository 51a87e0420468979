//! The cached SwapAttempts grouped by the InstanceGeneration that owns
//! them, so a reconcile reads its own attempts instead of scanning (and
//! copying) every attempt in the cache: a plan's cost no longer grows with
//! the number of InstanceGenerations.
//!
//! It is the attempts' cache (there is no reflector store beside it): fed
//! each event of the attempt watch before the reconcile that event wakes is
//! queued, it alone answers both "which attempts does this IG own" and "has
//! this replica's create reached the cache", so a plan never sees an
//! attempt the expectations have not, or the other way round.
//!
//! Ownership is the ownerReference to the IG's uid: an IG deleted and
//! re-created under the same name is a new object, and the old one's
//! attempts are not its history. Only an object that never passed through
//! an API server lacks a uid; its attempts (which carry no owner either)
//! are found by the instance label. Attempts that failed to deserialize are
//! left out.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::core::DeserializeGuard;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};

use crate::cached_attempt::CachedAttempt;
use genswap_core::scheduler::{LABEL_INSTANCE, label_value};

/// Whose attempts: an IG's uid, or (for an object without one) its label.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Owner {
    Uid(String),
    Label(String),
}

/// (namespace, owner).
type OwnerKey = (String, Owner);

/// (namespace, attempt name).
type AttemptKey = (String, String);

#[derive(Debug, Default)]
struct Contents {
    by_owner: HashMap<OwnerKey, BTreeMap<String, Arc<CachedAttempt>>>,
    /// The owners each cached attempt is filed under, for updates and deletes.
    owners_of: HashMap<AttemptKey, Vec<OwnerKey>>,
}

#[derive(Debug, Default)]
struct State {
    live: Contents,
    /// Attempts listed since the watch (re)started; replaces `live` when
    /// the list completes, so attempts deleted meanwhile disappear.
    relisting: Option<Contents>,
}

/// Shared between the watch that feeds it and every reconcile.
#[derive(Clone, Debug, Default)]
pub struct AttemptIndex(Arc<RwLock<State>>);

impl AttemptIndex {
    pub fn new() -> AttemptIndex {
        AttemptIndex::default()
    }

    /// Folds one event of the attempt watch in.
    pub fn observe(&self, event: &watcher::Event<DeserializeGuard<SwapAttempt>>) {
        let mut state = self.0.write().unwrap_or_else(PoisonError::into_inner);
        match event {
            watcher::Event::Apply(guard) => state.live.apply(guard),
            watcher::Event::Delete(guard) => match &guard.0 {
                Ok(attempt) => state.live.remove(&attempt_key(attempt)),
                Err(invalid) => {
                    if let Some(key) = invalid_key(invalid) {
                        state.live.remove(&key);
                    }
                }
            },
            watcher::Event::Init => state.relisting = Some(Contents::default()),
            watcher::Event::InitApply(guard) => state
                .relisting
                .get_or_insert_with(Contents::default)
                .apply(guard),
            watcher::Event::InitDone => {
                if let Some(listed) = state.relisting.take() {
                    state.live = listed;
                }
            }
        }
    }

    /// The attempts `ig` owns, sorted by (node, revision), built for one
    /// plan from the compact entries.
    pub fn attempts_of(&self, ig: &InstanceGeneration) -> Vec<SwapAttempt> {
        let owner = owner_key_of(ig);
        let mut owned: Vec<Arc<CachedAttempt>> = {
            let state = self.0.read().unwrap_or_else(PoisonError::into_inner);
            match state.live.by_owner.get(&owner) {
                Some(found) => found.values().cloned().collect(),
                None => return Vec::new(),
            }
        };
        owned.sort_by(|a, b| (a.node_name(), a.sched_rev()).cmp(&(b.node_name(), b.sched_rev())));
        owned.iter().map(|a| a.to_attempt(&owner.0)).collect()
    }

    /// Whether attempt `name` in `namespace` is cached.
    pub fn contains(&self, namespace: &str, name: &str) -> bool {
        let state = self.0.read().unwrap_or_else(PoisonError::into_inner);
        state
            .live
            .owners_of
            .contains_key(&(namespace.to_string(), name.to_string()))
    }

    /// The record annotation on cached attempt `name` in `namespace`:
    /// `None` when the attempt is not cached.
    pub fn record_on(&self, namespace: &str, name: &str) -> Option<Option<String>> {
        let state = self.0.read().unwrap_or_else(PoisonError::into_inner);
        let key = (namespace.to_string(), name.to_string());
        let owner = state.live.owners_of.get(&key)?.first()?;
        let attempt = state.live.by_owner.get(owner)?.get(name)?;
        Some(attempt.record().map(str::to_string))
    }

    /// How many attempts are cached, for tests and metrics.
    pub fn len(&self) -> usize {
        let state = self.0.read().unwrap_or_else(PoisonError::into_inner);
        state.live.owners_of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Contents {
    /// An attempt that does not deserialize is cached (a create of it has
    /// reached the cache) but owned by nobody: no plan reads it.
    fn apply(&mut self, guard: &DeserializeGuard<SwapAttempt>) {
        match &guard.0 {
            Ok(attempt) => self.insert(attempt),
            Err(invalid) => {
                if let Some(key) = invalid_key(invalid) {
                    self.remove(&key);
                    self.owners_of.insert(key, Vec::new());
                }
            }
        }
    }

    fn insert(&mut self, attempt: &SwapAttempt) {
        let key = attempt_key(attempt);
        self.remove(&key);
        let owners = owners(attempt);
        let shared = Arc::new(CachedAttempt::of(attempt));
        for owner in &owners {
            self.by_owner
                .entry(owner.clone())
                .or_default()
                .insert(key.1.clone(), shared.clone());
        }
        self.owners_of.insert(key, owners);
    }

    fn remove(&mut self, key: &AttemptKey) {
        let Some(owners) = self.owners_of.remove(key) else {
            return;
        };
        for owner in owners {
            if let Some(attempts) = self.by_owner.get_mut(&owner) {
                attempts.remove(&key.1);
                if attempts.is_empty() {
                    self.by_owner.remove(&owner);
                }
            }
        }
    }
}

fn attempt_key(attempt: &SwapAttempt) -> AttemptKey {
    (attempt.namespace().unwrap_or_default(), attempt.name_any())
}

/// The key of an attempt that failed to deserialize, from its metadata.
fn invalid_key(invalid: &kube::core::error_boundary::InvalidObject) -> Option<AttemptKey> {
    let meta = &invalid.metadata;
    Some((
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone()?,
    ))
}

/// The IGs `attempt` is filed under: each InstanceGeneration owner, or its
/// instance label when it has none.
fn owners(attempt: &SwapAttempt) -> Vec<OwnerKey> {
    let namespace = attempt.namespace().unwrap_or_default();
    let kind = InstanceGeneration::kind(&());
    let by_uid: Vec<OwnerKey> = attempt
        .owner_references()
        .iter()
        .filter(|owner| owner.kind == kind)
        .map(|owner| (namespace.clone(), Owner::Uid(owner.uid.clone())))
        .collect();
    if !by_uid.is_empty() {
        return by_uid;
    }
    match attempt.labels().get(LABEL_INSTANCE) {
        Some(label) => vec![(namespace, Owner::Label(label.clone()))],
        None => Vec::new(),
    }
}

fn owner_key_of(ig: &InstanceGeneration) -> OwnerKey {
    let namespace = ig.namespace().unwrap_or_default();
    match ig.uid() {
        Some(uid) => (namespace, Owner::Uid(uid)),
        None => (namespace, Owner::Label(label_value(&ig.name_any()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use genswap_crds::InstanceGenerationSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
    use serde_json::json;

    fn ig(name: &str, uid: Option<&str>) -> InstanceGeneration {
        let spec: InstanceGenerationSpec = serde_json::from_value(json!({
            "build": {"id": "b1", "artifact": {"path": "/srv/b1"}, "sha256": "0".repeat(64)}
        }))
        .expect("a spec");
        let mut ig = InstanceGeneration::new(name, spec);
        ig.metadata.namespace = Some("prod".into());
        ig.metadata.uid = uid.map(str::to_string);
        ig
    }

    fn attempt(
        name: &str,
        namespace: &str,
        owner_uid: Option<&str>,
        node: &str,
        rev: i64,
    ) -> SwapAttempt {
        let mut attempt: SwapAttempt = serde_json::from_value(json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "SwapAttempt",
            "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_INSTANCE: "web"}},
            "spec": {
                "instance": "web", "nodeName": node, "schedRev": rev, "cause": "install", "mode": "overlap",
                "build": {"id": "b1", "artifact": {"path": "/srv/b1"}, "sha256": "0".repeat(64)}
            }
        }))
        .expect("an attempt");
        if let Some(uid) = owner_uid {
            attempt.metadata.owner_references = Some(vec![OwnerReference {
                api_version: "genswap.dev/v1alpha1".into(),
                kind: "InstanceGeneration".into(),
                name: "web".into(),
                uid: uid.into(),
                ..OwnerReference::default()
            }]);
        }
        attempt
    }

    fn apply(index: &AttemptIndex, attempt: SwapAttempt) {
        index.observe(&watcher::Event::Apply(DeserializeGuard(Ok(attempt))));
    }

    fn names(attempts: &[SwapAttempt]) -> Vec<String> {
        attempts.iter().map(|a| a.name_any()).collect()
    }

    #[test]
    fn an_ig_sees_its_own_attempts_sorted_by_node_then_revision() {
        let index = AttemptIndex::new();
        apply(&index, attempt("web-b-2", "prod", Some("u1"), "b", 2));
        apply(&index, attempt("web-a-3", "prod", Some("u1"), "a", 3));
        apply(&index, attempt("web-a-1", "prod", Some("u1"), "a", 1));
        // Same name, other owner (an IG deleted and re-created), other namespace.
        apply(&index, attempt("web-a-0", "prod", Some("u0"), "a", 0));
        apply(&index, attempt("web-c-1", "staging", Some("u1"), "c", 1));
        assert_eq!(
            names(&index.attempts_of(&ig("web", Some("u1")))),
            ["web-a-1", "web-a-3", "web-b-2"]
        );
        assert_eq!(
            names(&index.attempts_of(&ig("web", Some("u2")))),
            Vec::<String>::new()
        );
    }

    #[test]
    fn an_object_without_a_uid_finds_unowned_attempts_by_label() {
        let index = AttemptIndex::new();
        apply(&index, attempt("web-a-1", "prod", None, "a", 1));
        apply(&index, attempt("web-a-2", "prod", Some("u1"), "a", 2));
        assert_eq!(names(&index.attempts_of(&ig("web", None))), ["web-a-1"]);
    }

    #[test]
    fn updates_replace_and_deletes_remove() {
        let index = AttemptIndex::new();
        apply(&index, attempt("web-a-1", "prod", Some("u1"), "a", 1));
        let mut reported = attempt("web-a-1", "prod", Some("u1"), "a", 1);
        reported.status = Some(Default::default());
        apply(&index, reported.clone());
        let seen = index.attempts_of(&ig("web", Some("u1")));
        assert_eq!(seen.len(), 1);
        assert!(seen[0].status.is_some(), "the newer copy");
        index.observe(&watcher::Event::Delete(DeserializeGuard(Ok(reported))));
        assert!(index.attempts_of(&ig("web", Some("u1"))).is_empty());
        assert!(!index.contains("prod", "web-a-1"));
        assert!(index.is_empty());
    }

    #[test]
    fn a_relist_drops_what_was_deleted_while_the_watch_was_down() {
        let index = AttemptIndex::new();
        apply(&index, attempt("web-a-1", "prod", Some("u1"), "a", 1));
        apply(&index, attempt("web-a-2", "prod", Some("u1"), "a", 2));
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitApply(DeserializeGuard(Ok(attempt(
            "web-a-2",
            "prod",
            Some("u1"),
            "a",
            2,
        )))));
        // Until the list completes, the old contents answer.
        assert_eq!(index.len(), 2);
        index.observe(&watcher::Event::InitDone);
        assert_eq!(
            names(&index.attempts_of(&ig("web", Some("u1")))),
            ["web-a-2"]
        );
    }

    #[test]
    fn an_attempt_that_does_not_deserialize_is_cached_but_planned_by_nobody() {
        let index = AttemptIndex::new();
        let invalid = kube::core::error_boundary::InvalidObject {
            error: "bad".into(),
            metadata: ObjectMeta {
                name: Some("web-a-1".into()),
                namespace: Some("prod".into()),
                ..ObjectMeta::default()
            },
        };
        index.observe(&watcher::Event::Apply(DeserializeGuard(Err(invalid))));
        assert!(index.contains("prod", "web-a-1"));
        assert!(index.attempts_of(&ig("web", Some("u1"))).is_empty());
    }
}
