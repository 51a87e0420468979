//! Per-node inboxes: what lets every node agent watch one object by name
//! instead of every SwapAttempt through a `spec.nodeName` field selector.
//!
//! The API server's watch cache indexes a watch by namespace and exact
//! `metadata.name` only; a field selector on a custom resource is matched
//! against every event, so a fleet of N agents made each attempt cost the
//! server O(N) (docs/BENCHMARKS.md, "Watch fan-out"). An inbox is the
//! ConfigMap [`inbox_name`]`(node)` in the controller's namespace, one
//! `data` entry per SwapAttempt of that node that exists: the attempt's uid
//! → `<namespace>/<name>` ([`inbox_entry`]). The agent watches its inbox by
//! name and reads each attempt that appears in it (node-agent's
//! `kube::inbox`).
//!
//! The inboxes are level-triggered from the controller's own attempt watch
//! ([`InboxIndex`]): each event marks its node, and [`keep_inboxes`] writes
//! the difference between what the node's inbox should hold and what this
//! replica last wrote, as a JSON merge patch (`null` removes an entry). A
//! merge patch needs no read and no resourceVersion, so it never conflicts;
//! with one write in flight per node, the changes of a burst coalesce into
//! few writes. An inbox that would be empty is deleted (by a controller of
//! every namespace; one scoped to a namespace leaves it, as other scopes'
//! controllers may share it, and touches only its own entries). Only the
//! leader writes; on becoming leader it lists the inboxes to learn what
//! they hold.
//!
//! The delete of a finished attempt while a newer attempt of its instance
//! is listed for the node writes nothing: its entry stays in the inbox
//! until the node's next write (its next new attempt, mostly), whose patch
//! removes it with the rest of what differs from the last write. A release
//! then costs one inbox write per node, not one for the attempt it adds
//! and one more for the attempt it replaces, and the index keeps no copy
//! of what waits (at 1,000 × 10 it was 85 % of what a release added to the
//! heap at rest). Its agent skips a listed attempt that is gone. A replica
//! that lists anew (its watch relists, or it becomes leader and lists the
//! inboxes) writes every node whose inbox differs, waiting entries too.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use genswap_crds::SwapAttempt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::core::DeserializeGuard;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::{Map, Value};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::leader::Leadership;
use genswap_core::scheduler::{
    LABEL_INBOX, inbox_entry, inbox_name, label_value, parse_inbox_entry,
};

/// An inbox's entries: attempt uid → `<namespace>/<name>`.
pub type Entries = BTreeMap<Uid, Box<str>>;

/// The uids an inbox holds, sorted: all a writer needs to remember of
/// what it wrote, since a uid's entry never changes.
pub type Held = Box<[Uid]>;

/// An attempt's uid as the inboxes keep it: the API server's uids are
/// UUIDs, 16 bytes where their text takes 36 and an allocation (the uid is
/// kept once per attempt in the index, its filing and the writer's record:
/// at 100,000 attempts that was tens of MiB). Any other text is kept as
/// it is, so a uid always reads back as written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Uid {
    Uuid([u8; 16]),
    Other(Box<str>),
}

impl Uid {
    pub fn new(text: &str) -> Self {
        if let Ok(uuid) = uuid::Uuid::try_parse(text) {
            let mut canonical = [0u8; uuid::fmt::Hyphenated::LENGTH];
            if uuid.hyphenated().encode_lower(&mut canonical) == text {
                return Self::Uuid(uuid.into_bytes());
            }
        }
        Self::Other(text.into())
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uuid(bytes) => uuid::Uuid::from_bytes(*bytes).hyphenated().fmt(f),
            Self::Other(text) => f.write_str(text),
        }
    }
}

/// How long a node whose inbox write failed waits before it is tried again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Inbox writes in flight at once (as many as reconciles): a relist of a
/// large fleet marks every node at once.
pub const WRITES_AT_ONCE: usize = 16;

#[derive(Debug, Default)]
struct Listed {
    by_node: HashMap<Arc<str>, Entries>,
    /// Where each cached attempt is filed, for its delete.
    filed: HashMap<Uid, Filed>,
    /// Each instance with an attempt filed, once: a fleet has many
    /// attempts of few instances.
    instances: HashSet<Arc<Instance>>,
}

/// An attempt's namespace and InstanceGeneration.
type Instance = (String, String);

#[derive(Debug)]
struct Filed {
    /// The key of the node's entries in `by_node`.
    node: Arc<str>,
    /// Shared with `instances`.
    instance: Arc<Instance>,
}

impl Listed {
    /// Files `attempt`; returns the nodes whose inbox changed.
    fn apply(&mut self, attempt: &SwapAttempt) -> Vec<String> {
        let (Some(uid), Some(namespace)) = (attempt.uid(), attempt.namespace()) else {
            return Vec::new();
        };
        let uid = Uid::new(&uid);
        let node_name = attempt.spec.node_name.as_str();
        let node = match self.by_node.get_key_value(node_name) {
            Some((node, _)) => node.clone(),
            None => Arc::from(node_name),
        };
        let instance = (namespace.clone(), attempt.spec.instance.clone());
        let instance = match self.instances.get(&instance) {
            Some(instance) => instance.clone(),
            None => {
                let instance = Arc::new(instance);
                self.instances.insert(instance.clone());
                instance
            }
        };
        let filed = Filed {
            node: node.clone(),
            instance,
        };
        let mut touched = Vec::new();
        if let Some(before) = self.filed.insert(uid.clone(), filed)
            && before.node != node
        {
            self.remove_from(&before.node, &uid);
            touched.push(before.node.to_string());
        }
        let entry = inbox_entry(&namespace, &attempt.name_any());
        let entries = self.by_node.entry(node.clone()).or_default();
        if entries.get(&uid).map(|held| &**held) != Some(entry.as_str()) {
            entries.insert(uid, entry.into());
            touched.push(node.to_string());
        }
        touched
    }

    /// Unfiles a deleted attempt; returns its node when its inbox must be
    /// written now.
    ///
    /// A finished attempt whose instance has a newer attempt on the node
    /// leaves without a write of its own: its agent is done with it (its
    /// delete only makes the agent forget it, and a listed attempt that is
    /// gone is skipped), and a release would otherwise cost an inbox write
    /// for each attempt it adds and another for each it replaces. The
    /// node's next write removes it.
    fn remove(&mut self, attempt: &SwapAttempt) -> Option<String> {
        let uid = Uid::new(&attempt.uid()?);
        let Filed { node, instance } = self.filed.remove(&uid)?;
        self.remove_from(&node, &uid);
        let finished = attempt.status.as_ref().is_some_and(|s| s.outcome.is_some());
        let sibling_listed = self.by_node.get(&node).is_some_and(|entries| {
            entries.keys().any(|other| {
                self.filed
                    .get(other)
                    .is_some_and(|f| Arc::ptr_eq(&f.instance, &instance))
            })
        });
        if !sibling_listed && Arc::strong_count(&instance) == 2 {
            // Only `instances` and this attempt held it: the last attempt
            // of the instance anywhere is gone.
            self.instances.remove(&instance);
        }
        (!(finished && sibling_listed)).then(|| node.to_string())
    }

    fn remove_from(&mut self, node: &str, uid: &Uid) {
        if let Some(entries) = self.by_node.get_mut(node) {
            entries.remove(uid);
            if entries.is_empty() {
                self.by_node.remove(node);
            }
        }
    }
}

#[derive(Debug, Default)]
struct State {
    live: Listed,
    relisting: Option<Listed>,
    /// Nodes whose inbox may differ from what was last written.
    dirty: BTreeSet<String>,
    /// Whether the attempt watch has listed once.
    synced: bool,
}

/// What every node's inbox should hold, from the controller's attempt
/// watch. Shared between that watch and [`keep_inboxes`].
#[derive(Clone, Debug, Default)]
pub struct InboxIndex {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
}

impl InboxIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Folds one event of the attempt watch in. Attempts that failed to
    /// deserialize are left out: their node is unknown, and an agent could
    /// not read them either.
    pub fn observe(&self, event: &watcher::Event<DeserializeGuard<SwapAttempt>>) {
        let mut state = self.lock();
        let State {
            live,
            relisting,
            dirty,
            synced,
        } = &mut *state;
        match event {
            watcher::Event::Apply(DeserializeGuard(Ok(attempt))) => {
                dirty.extend(live.apply(attempt));
            }
            watcher::Event::Delete(DeserializeGuard(Ok(attempt))) => {
                if let Some(node) = live.remove(attempt) {
                    dirty.insert(node);
                }
            }
            watcher::Event::Apply(_) | watcher::Event::Delete(_) => return,
            watcher::Event::Init => *relisting = Some(Listed::default()),
            watcher::Event::InitApply(DeserializeGuard(Ok(attempt))) => {
                relisting.get_or_insert_with(Listed::default).apply(attempt);
                return;
            }
            watcher::Event::InitApply(_) => return,
            watcher::Event::InitDone => {
                if let Some(listed) = relisting.take() {
                    dirty.extend(live.by_node.keys().map(|node| node.to_string()));
                    dirty.extend(listed.by_node.keys().map(|node| node.to_string()));
                    *live = listed;
                }
                *synced = true;
            }
        }
        drop(state);
        self.changed.notify_one();
    }

    /// What `node`'s inbox should hold now.
    pub fn desired(&self, node: &str) -> Entries {
        self.lock()
            .live
            .by_node
            .get(node)
            .cloned()
            .unwrap_or_default()
    }

    fn mark(&self, nodes: impl IntoIterator<Item = String>) {
        self.lock().dirty.extend(nodes);
        self.changed.notify_one();
    }

    /// The marked nodes, unmarked, once the watch has listed.
    fn take_dirty(&self) -> Vec<String> {
        let mut state = self.lock();
        if !state.synced {
            return Vec::new();
        }
        std::mem::take(&mut state.dirty).into_iter().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The JSON merge patch that turns an inbox holding `written` into one
/// holding `desired`, or `None` when they are the same.
pub fn merge_patch(written: &[Uid], desired: &Entries) -> Option<Value> {
    let mut data = Map::new();
    for (uid, entry) in desired {
        if written.binary_search(uid).is_err() {
            data.insert(uid.to_string(), Value::String(entry.to_string()));
        }
    }
    for uid in written {
        if !desired.contains_key(uid) {
            data.insert(uid.to_string(), Value::Null);
        }
    }
    (!data.is_empty()).then(|| serde_json::json!({ "data": data }))
}

/// The uids of `entries`, as a writer remembers them.
pub fn uids_of(entries: &Entries) -> Held {
    entries.keys().cloned().collect()
}

fn holds_exactly(held: Option<&Held>, desired: &Entries) -> bool {
    held.map_or(&[][..], |held| &held[..])
        .iter()
        .eq(desired.keys())
}

/// Which inbox entries this replica keeps: those of the namespace it
/// watches, or all. Controllers scoped to different namespaces may share
/// the inboxes' namespace; each patches only its own entries and none
/// deletes an inbox another may still fill.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope(pub Option<String>);

impl Scope {
    fn keeps(&self, entry: &str) -> bool {
        match &self.0 {
            None => true,
            Some(only) => parse_inbox_entry(entry).is_some_and(|(namespace, _)| namespace == only),
        }
    }

    /// The uids of `data` this replica keeps.
    fn of(&self, data: Option<BTreeMap<String, String>>) -> Held {
        let mut held: Vec<Uid> = data
            .unwrap_or_default()
            .into_iter()
            .filter(|(_, entry)| self.keeps(entry))
            .map(|(uid, _)| Uid::new(&uid))
            .collect();
        held.sort_unstable();
        held.into()
    }
}

/// Keeps every node's inbox in `namespace` equal to what `index` says, for
/// the attempts in `scope`, while this replica leads. Runs until dropped.
pub async fn keep_inboxes(
    client: Client,
    namespace: String,
    scope: Scope,
    index: InboxIndex,
    leadership: Leadership,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let inboxes = Inboxes { api, scope };
    loop {
        leadership.until(true).await;
        let mut written = match inboxes.list().await {
            Ok(written) => written,
            Err(error) => {
                warn!(%error, %namespace, "listing the node inboxes failed; retrying");
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            }
        };
        info!(%namespace, inboxes = written.len(), "keeping the node inboxes");
        index.mark(written.keys().cloned().collect::<Vec<_>>());
        keep_while_leading(&inboxes, &index, &leadership, &mut written).await;
    }
}

/// The inboxes' namespace, and what of them this replica keeps.
#[derive(Clone)]
struct Inboxes {
    api: Api<ConfigMap>,
    scope: Scope,
}

impl Inboxes {
    /// What the inboxes hold now (of this replica's scope), by node.
    async fn list(&self) -> Result<HashMap<String, Held>, kube::Error> {
        let listed = self
            .api
            .list(&ListParams::default().labels(LABEL_INBOX))
            .await?;
        Ok(listed
            .items
            .into_iter()
            .filter_map(|inbox| {
                let node = inbox.annotations().get(ANNOTATION_NODE)?.clone();
                Some((node, self.scope.of(inbox.data)))
            })
            .collect())
    }

    /// Makes `node`'s inbox hold `desired`, given that it held `before`
    /// (`None`: it did not exist, as far as this replica knows). Returns
    /// what it holds after (of this replica's scope).
    async fn write(
        &self,
        node: &str,
        before: Option<&Held>,
        desired: &Entries,
    ) -> Result<Option<Held>, kube::Error> {
        let name = inbox_name(node);
        if desired.is_empty() && self.scope.0.is_none() {
            return match self.api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => Ok(None),
                Err(kube::Error::Api(status)) if status.is_not_found() => Ok(None),
                Err(error) => Err(error),
            };
        }
        let Some(before) = before else {
            return self.create(node, desired).await;
        };
        let Some(patch) = merge_patch(before, desired) else {
            return Ok(Some(uids_of(desired)));
        };
        match self
            .api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => Ok(Some(uids_of(desired))),
            Err(kube::Error::Api(status)) if status.is_not_found() => {
                self.create(node, desired).await
            }
            Err(error) => Err(error),
        }
    }

    async fn create(&self, node: &str, desired: &Entries) -> Result<Option<Held>, kube::Error> {
        let name = inbox_name(node);
        let inbox = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(
                    LABEL_INBOX.to_string(),
                    label_value(node),
                )])),
                annotations: Some(BTreeMap::from([(
                    ANNOTATION_NODE.to_string(),
                    node.to_string(),
                )])),
                ..ObjectMeta::default()
            },
            data: Some(
                desired
                    .iter()
                    .map(|(uid, entry)| (uid.to_string(), entry.to_string()))
                    .collect(),
            ),
            ..ConfigMap::default()
        };
        match self.api.create(&PostParams::default(), &inbox).await {
            Ok(_) => Ok(Some(uids_of(desired))),
            // Written by another replica, or another scope's controller,
            // since this one looked: learn what it holds and patch the
            // difference.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                let held = self.scope.of(self.api.get(&name).await?.data);
                match merge_patch(&held, desired) {
                    None => Ok(Some(held)),
                    Some(patch) => {
                        self.api
                            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                            .await?;
                        Ok(Some(uids_of(desired)))
                    }
                }
            }
            Err(error) => Err(error),
        }
    }
}

/// The node an inbox is for, in full (its label may be shortened).
const ANNOTATION_NODE: &str = "genswap.dev/node";

/// What one node's write ended with.
struct Written {
    node: String,
    /// What the inbox now holds (`None`: it does not exist), or the error.
    result: Result<Option<Held>, kube::Error>,
}

async fn keep_while_leading(
    inboxes: &Inboxes,
    index: &InboxIndex,
    leadership: &Leadership,
    written: &mut HashMap<String, Held>,
) {
    let mut in_flight: JoinSet<Written> = JoinSet::new();
    let mut writing: BTreeSet<String> = BTreeSet::new();
    let mut retries: JoinSet<String> = JoinSet::new();
    loop {
        if !leadership.is_leader() {
            in_flight.abort_all();
            debug!("no longer leading; the inboxes are left to the next leader");
            return;
        }
        let mut deferred = Vec::new();
        for node in index.take_dirty() {
            if writing.contains(&node) || writing.len() >= WRITES_AT_ONCE {
                // Written once a write in flight ends.
                deferred.push(node);
                continue;
            }
            let desired = index.desired(&node);
            let before = written.get(&node).cloned();
            if holds_exactly(before.as_ref(), &desired) {
                continue;
            }
            writing.insert(node.clone());
            let inboxes = inboxes.clone();
            let leadership = leadership.clone();
            in_flight.spawn(async move {
                let result = if leadership.is_leader() {
                    inboxes.write(&node, before.as_ref(), &desired).await
                } else {
                    Ok(before)
                };
                Written { node, result }
            });
        }
        if !deferred.is_empty() {
            index.lock().dirty.extend(deferred);
        }
        tokio::select! {
            () = index.changed.notified() => {}
            Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                let Ok(Written { node, result }) = done else { continue };
                writing.remove(&node);
                match result {
                    Ok(Some(entries)) => {
                        written.insert(node.clone(), entries);
                    }
                    Ok(None) => {
                        written.remove(&node);
                    }
                    Err(error) => {
                        warn!(%node, %error, "writing the node's inbox failed; retrying");
                        retries.spawn(async move {
                            tokio::time::sleep(RETRY_AFTER).await;
                            node
                        });
                        continue;
                    }
                }
                // What changed while it was written marked it again (and
                // was deferred above); a waiting removal did not, and waits
                // for the node's next write.
            }
            Some(Ok(node)) = retries.join_next(), if !retries.is_empty() => index.mark([node]),
            () = leadership.until(false) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use genswap_crds::{Outcome, SwapAttemptStatus};

    fn attempt(name: &str, node: &str, uid: &str) -> DeserializeGuard<SwapAttempt> {
        let mut attempt: SwapAttempt =
            serde_json::from_value(test_cluster::objects::swap_attempt(name, node, 1))
                .expect("a SwapAttempt");
        attempt.metadata.namespace = Some("apps".into());
        attempt.metadata.uid = Some(uid.into());
        DeserializeGuard(Ok(attempt))
    }

    fn entries(pairs: &[(&str, &str)]) -> Entries {
        pairs
            .iter()
            .map(|(uid, entry)| (Uid::new(uid), Box::from(*entry)))
            .collect()
    }

    #[test]
    fn an_attempt_is_filed_under_its_node_and_leaves_on_delete() {
        let index = InboxIndex::new();
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitDone);
        let a = attempt("web-n1-1", "n1", "u1");
        index.observe(&watcher::Event::Apply(a));
        index.observe(&watcher::Event::Apply(attempt("web-n2-1", "n2", "u2")));
        assert_eq!(index.desired("n1"), entries(&[("u1", "apps/web-n1-1")]));
        assert_eq!(index.take_dirty(), vec!["n1".to_string(), "n2".to_string()]);
        index.observe(&watcher::Event::Delete(attempt("web-n1-1", "n1", "u1")));
        assert_eq!(index.desired("n1"), Entries::new());
        assert_eq!(index.take_dirty(), vec!["n1".to_string()]);
    }

    fn finished(attempt: DeserializeGuard<SwapAttempt>) -> DeserializeGuard<SwapAttempt> {
        let DeserializeGuard(Ok(mut attempt)) = attempt else {
            unreachable!("built whole")
        };
        attempt.status = Some(SwapAttemptStatus {
            outcome: Some(Outcome::Done),
            ..SwapAttemptStatus::default()
        });
        DeserializeGuard(Ok(attempt))
    }

    fn synced() -> InboxIndex {
        let index = InboxIndex::new();
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitDone);
        index
    }

    #[test]
    fn a_replaced_finished_attempt_leaves_with_the_nodes_next_new_attempt() {
        let index = synced();
        index.observe(&watcher::Event::Apply(attempt("web-n1-1", "n1", "u1")));
        index.observe(&watcher::Event::Apply(attempt("web-n1-2", "n1", "u2")));
        assert_eq!(index.take_dirty(), vec!["n1".to_string()]);

        // The release's outcome is recorded and the attempt it replaced
        // deleted: nothing is written for it, and the index keeps nothing
        // of it.
        index.observe(&watcher::Event::Delete(finished(attempt(
            "web-n1-1", "n1", "u1",
        ))));
        assert!(index.take_dirty().is_empty());
        assert_eq!(index.desired("n1"), entries(&[("u2", "apps/web-n1-2")]));

        // Another instance's attempt on the node is new too: its write is
        // the difference from the last one, the waiting removal included.
        let mut other = attempt("db-n1-1", "n1", "u3");
        if let DeserializeGuard(Ok(other)) = &mut other {
            other.spec.instance = "db".into();
        }
        index.observe(&watcher::Event::Apply(other));
        assert_eq!(index.take_dirty(), vec!["n1".to_string()]);
        let desired = index.desired("n1");
        assert_eq!(
            desired,
            entries(&[("u2", "apps/web-n1-2"), ("u3", "apps/db-n1-1")])
        );
        let written = uids_of(&entries(&[
            ("u1", "apps/web-n1-1"),
            ("u2", "apps/web-n1-2"),
        ]));
        assert_eq!(
            merge_patch(&written, &desired),
            Some(serde_json::json!({"data": {"u1": null, "u3": "apps/db-n1-1"}}))
        );
    }

    #[test]
    fn an_unfinished_or_last_attempt_leaves_at_once() {
        let index = synced();
        index.observe(&watcher::Event::Apply(attempt("web-n1-1", "n1", "u1")));
        index.observe(&watcher::Event::Apply(attempt("web-n1-2", "n1", "u2")));
        index.observe(&watcher::Event::Apply(attempt("web-n1-3", "n1", "u3")));
        let _ = index.take_dirty();

        // Deleted before its outcome: the agent may be running it, and
        // cancels it only when it sees the delete.
        index.observe(&watcher::Event::Delete(attempt("web-n1-2", "n1", "u2")));
        assert_eq!(index.take_dirty(), vec!["n1".to_string()]);
        assert_eq!(
            index.desired("n1"),
            entries(&[("u1", "apps/web-n1-1"), ("u3", "apps/web-n1-3")])
        );

        // The node leaves the selector: every attempt of the instance is
        // deleted; the first waits, the last is written (and the inbox,
        // now empty, deleted).
        index.observe(&watcher::Event::Delete(finished(attempt(
            "web-n1-1", "n1", "u1",
        ))));
        assert!(index.take_dirty().is_empty());
        index.observe(&watcher::Event::Delete(finished(attempt(
            "web-n1-3", "n1", "u3",
        ))));
        assert_eq!(index.take_dirty(), vec!["n1".to_string()]);
        assert_eq!(index.desired("n1"), Entries::new());
    }

    #[test]
    fn nothing_is_written_before_the_first_list_and_a_relist_marks_old_and_new_nodes() {
        let index = InboxIndex::new();
        index.observe(&watcher::Event::Apply(attempt("a", "gone", "u0")));
        assert!(index.take_dirty().is_empty(), "not synced yet");
        index.observe(&watcher::Event::Init);
        index.observe(&watcher::Event::InitApply(attempt("b", "n1", "u1")));
        index.observe(&watcher::Event::InitDone);
        assert_eq!(
            index.take_dirty(),
            vec!["gone".to_string(), "n1".to_string()]
        );
        assert_eq!(index.desired("gone"), Entries::new());
        assert_eq!(index.desired("n1"), entries(&[("u1", "apps/b")]));
    }

    #[test]
    fn the_merge_patch_adds_and_removes_only_the_difference() {
        let written = uids_of(&entries(&[("u1", "apps/a"), ("u2", "apps/b")]));
        let desired = entries(&[("u2", "apps/b"), ("u3", "apps/c")]);
        assert_eq!(
            merge_patch(&written, &desired),
            Some(serde_json::json!({"data": {"u1": null, "u3": "apps/c"}}))
        );
        assert_eq!(merge_patch(&uids_of(&desired), &desired), None);
    }

    #[test]
    fn a_uuid_is_kept_as_16_bytes_and_any_uid_reads_back_as_written() {
        let uuid = "0f8fad5b-d9cb-469f-a165-70867728950e";
        assert!(matches!(Uid::new(uuid), Uid::Uuid(_)));
        for text in [
            uuid,
            "0F8FAD5B-D9CB-469F-A165-70867728950E",
            "0f8fad5bd9cb469fa16570867728950e",
            "u1",
            "",
        ] {
            assert_eq!(Uid::new(text).to_string(), text);
        }
        assert!(matches!(
            Uid::new("0f8fad5bd9cb469fa16570867728950e"),
            Uid::Other(_)
        ));
    }

    #[test]
    fn an_instance_is_kept_once_and_forgotten_with_its_last_attempt() {
        let index = synced();
        for (name, node, uid) in [("web-n1-1", "n1", "u1"), ("web-n2-1", "n2", "u2")] {
            index.observe(&watcher::Event::Apply(attempt(name, node, uid)));
        }
        assert_eq!(index.lock().live.instances.len(), 1);
        index.observe(&watcher::Event::Delete(attempt("web-n1-1", "n1", "u1")));
        assert_eq!(index.lock().live.instances.len(), 1);
        index.observe(&watcher::Event::Delete(attempt("web-n2-1", "n2", "u2")));
        assert!(index.lock().live.instances.is_empty());
        assert!(index.lock().live.by_node.is_empty());
    }

    type MockHandle = tower_test::mock::Handle<
        http::Request<kube::client::Body>,
        http::Response<axum::body::Body>,
    >;

    /// The next request the keeper sends, within a generous deadline (a
    /// change it lost would never be sent), with its JSON body.
    async fn next_request(
        handle: &mut MockHandle,
    ) -> (
        http::Method,
        String,
        Value,
        tower_test::mock::SendResponse<http::Response<axum::body::Body>>,
    ) {
        let (request, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
            .await
            .expect("the keeper writes within 10 s")
            .expect("the keeper is running");
        let (parts, body) = request.into_parts();
        let body = http_body_util::BodyExt::collect(body)
            .await
            .expect("a request body")
            .to_bytes();
        let body = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).expect("a JSON body")
        };
        (parts.method, parts.uri.to_string(), body, send)
    }

    fn respond(body: Value) -> http::Response<axum::body::Body> {
        http::Response::builder()
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(body.to_string()))
            .expect("a response")
    }

    #[tokio::test]
    async fn a_change_while_the_nodes_write_is_in_flight_goes_out_in_its_next_write() {
        let (service, mut handle) = tower_test::mock::pair();
        let index = synced();
        let leadership = Leadership::follower(Arc::new(crate::metrics::Metrics::new()));
        leadership.set(true);
        let keeper = tokio::spawn(keep_inboxes(
            Client::new(service, "genswap"),
            "genswap".into(),
            Scope(None),
            index.clone(),
            leadership,
        ));
        let first = "0f8fad5b-d9cb-469f-a165-70867728950e";
        let second = "7c9e6679-7425-40de-944b-e07fc1f90ae7";

        let (method, _, _, send) = next_request(&mut handle).await;
        assert_eq!(
            method,
            http::Method::GET,
            "the keeper lists the inboxes first"
        );
        send.send_response(respond(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMapList",
            "metadata": {"resourceVersion": "1"}, "items": [],
        })));

        index.observe(&watcher::Event::Apply(attempt("web-n1-1", "n1", first)));
        let (method, _, created, send) = next_request(&mut handle).await;
        assert_eq!(method, http::Method::POST);
        assert_eq!(created["data"], serde_json::json!({first: "apps/web-n1-1"}));

        // The node's next attempt arrives while its inbox is being created.
        index.observe(&watcher::Event::Apply(attempt("web-n1-2", "n1", second)));
        send.send_response(respond(created));

        let (method, uri, patch, send) = next_request(&mut handle).await;
        assert_eq!(method, http::Method::PATCH, "{uri}");
        assert!(uri.contains(&inbox_name("n1")), "{uri}");
        assert_eq!(
            patch,
            serde_json::json!({"data": {second: "apps/web-n1-2"}}),
            "the next write is the change alone, after the first ended"
        );
        send.send_response(respond(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": inbox_name("n1")},
        })));
        keeper.abort();
    }

    #[test]
    fn a_scoped_controller_keeps_only_its_namespaces_entries() {
        let held = BTreeMap::from([
            ("u1".to_string(), "apps/a".to_string()),
            ("u2".to_string(), "other/b".to_string()),
        ]);
        assert_eq!(
            Scope(Some("apps".into())).of(Some(held.clone())),
            super::uids_of(&entries(&[("u1", "apps/a")]))
        );
        assert_eq!(
            Scope(None).of(Some(held)),
            super::uids_of(&entries(&[("u1", "apps/a"), ("u2", "other/b")]))
        );
    }
}
