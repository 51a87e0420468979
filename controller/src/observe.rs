//! The read side of a reconcile: what the Node cache holds (an IG's
//! attempts come from [`crate::attempt_index`]). No requests; the
//! reflectors keep the caches current.

use genswap_crds::{InstanceGeneration, SwapAttempt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;

use crate::cached_attempt::CachedAttempt;

/// The InstanceGeneration as the controller watches it: one that fails to
/// deserialize is still delivered (as an error) instead of breaking the
/// watch for every other object.
pub type WatchedIg = DeserializeGuard<InstanceGeneration>;

/// Every cached Node, ordered by name.
pub fn nodes(store: &Store<Node>) -> Vec<Node> {
    let mut nodes: Vec<Node> = store.state().iter().map(|node| (**node).clone()).collect();
    nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    nodes
}

/// Drops what the scheduler never reads before a Node enters the cache: it
/// reads names and labels only, while status (images, addresses,
/// conditions), managed fields and annotations are most of a Node's bytes,
/// and every reconcile copies the cached Nodes.
pub fn trim_node(node: &mut Node) {
    node.metadata = identity(std::mem::take(&mut node.metadata));
    node.status = None;
}

/// What of an object's metadata the controller reads: who it is, who owns
/// it, its labels and its lifecycle. Managed fields and annotations go.
fn identity(metadata: ObjectMeta) -> ObjectMeta {
    ObjectMeta {
        name: metadata.name,
        namespace: metadata.namespace,
        uid: metadata.uid,
        resource_version: metadata.resource_version,
        labels: metadata.labels,
        owner_references: metadata.owner_references,
        creation_timestamp: metadata.creation_timestamp,
        deletion_timestamp: metadata.deletion_timestamp,
        ..ObjectMeta::default()
    }
}

/// An attempt cut down to what the controller reads, as a `SwapAttempt`:
/// what the cache held before it kept [`CachedAttempt`]s. Not on the watch
/// path (the index compacts each attempt itself); it is the baseline the
/// `cache_footprint` bench measures the compact entry against, and the
/// tests plan from it to show that dropping the rest changes no decision.
/// Kept: names, owners, labels, the node record, the revision and desired
/// tuple, what the mode is derived from, and the outcome with `serving`.
pub fn trim_attempt(attempt: &mut SwapAttempt) {
    // What the index keeps is what the plan reads; the metadata the index
    // and the inboxes file it by stays too.
    let namespace = attempt.metadata.namespace.clone().unwrap_or_default();
    let mut trimmed = CachedAttempt::of(attempt).to_attempt(&namespace);
    trimmed.metadata = ObjectMeta {
        annotations: trimmed.metadata.annotations.take(),
        ..identity(std::mem::take(&mut attempt.metadata))
    };
    *attempt = trimmed;
}

/// An InstanceGeneration as the caches keep it: its managed fields are
/// never read, and its status writes are server-side applies that name no
/// managed fields.
pub fn trim_instance_generation(ig: &mut InstanceGeneration) {
    ig.metadata.managed_fields = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerImage, NodeStatus};
    use kube::ResourceExt;
    use std::collections::BTreeMap;

    use genswap_core::scheduler::plan;
    use genswap_crds::{
        ANNOTATION_RECORD, LastExit, Outcome, ServingState, ServingStatus, StepTiming,
        SwapAttemptStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time};
    use k8s_openapi::jiff::Timestamp;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + second).expect("a valid instant")
    }

    fn fleet_node(name: &str) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(BTreeMap::from([("pool".into(), "a".into())])),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    /// An IG with every setting an attempt copies, so trimming has
    /// something to drop.
    fn rich_ig(build: &str) -> InstanceGeneration {
        let mut ig: InstanceGeneration = serde_json::from_value(serde_json::json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "InstanceGeneration",
            "metadata": { "name": "web", "namespace": "apps", "uid": "u-1", "generation": 1 },
            "spec": {
                "build": { "id": build, "artifact": { "path": format!("/opt/{build}") },
                           "sha256": "a".repeat(64) },
                "nodeSelector": { "pool": "a" },
                "rollout": { "canaryNodes": 0, "maxParallel": 10 },
                "restartPolicy": "OnFailure",
                "process": { "args": ["--port", "8080"], "env": [{ "name": "A", "value": "b" }] },
                "listeners": [{ "name": "http", "tcp": "127.0.0.1:8080" }],
                "liveness": { "http": { "path": "/live" } },
                "sidecars": [{ "name": "log", "path": "/opt/log/run" }],
            },
        }))
        .expect("the fixture IG deserializes");
        ig.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
        ig
    }

    fn finish(attempt: &mut SwapAttempt, outcome: Outcome, serving: Option<ServingStatus>) {
        attempt.status = Some(SwapAttemptStatus {
            outcome: Some(outcome),
            generation: Some(attempt.spec.sched_rev),
            executed: Some(outcome != Outcome::Abandoned),
            reason: Some(format!("{outcome:?}")),
            started_at: Some(Time(at(1))),
            finished_at: Some(Time(at(2))),
            steps: vec![StepTiming {
                step: "spawn".into(),
                result: "ok".into(),
                millis: 3,
            }],
            serving,
            ..SwapAttemptStatus::default()
        });
        attempt.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
    }

    #[test]
    fn trimming_an_attempt_changes_no_plan() {
        let nodes: Vec<Node> = (0..5).map(|i| fleet_node(&format!("n{i}"))).collect();
        let mut ig = rich_ig("b1");
        let first = plan(&ig, &[] as &[SwapAttempt], &nodes, at(0));
        let mut attempts = first.create;
        assert_eq!(attempts.len(), 5, "every node gets an attempt");
        ig.status = Some(first.status);
        let exited = ServingStatus {
            state: ServingState::BackOff,
            generation: 1,
            restarts: 2,
            last_exit: Some(LastExit {
                generation: 1,
                exit_code: Some(1),
                signal: None,
                oom_killed: false,
                at: Time(at(3)),
                liveness_failed: None,
            }),
            restart_at: Some(Time(at(9))),
            message: Some("backing off".into()),
            listeners: Vec::new(),
            sidecars: Vec::new(),
        };
        finish(&mut attempts[0], Outcome::Done, Some(exited));
        finish(&mut attempts[1], Outcome::Failed, None);
        finish(&mut attempts[2], Outcome::Abandoned, None);
        finish(&mut attempts[3], Outcome::Down, None);
        // attempts[4] is still in flight.

        let mut trimmed = attempts.clone();
        trimmed.iter_mut().for_each(trim_attempt);
        assert!(trimmed.iter().all(|a| a.metadata.managed_fields.is_none()
            && a.spec.listeners.is_empty()
            && a.spec.liveness.is_none()
            && a.status.as_ref().is_none_or(|s| s.steps.is_empty())));
        let mut trimmed_ig = ig.clone();
        trim_instance_generation(&mut trimmed_ig);
        assert!(trimmed_ig.metadata.managed_fields.is_none());

        let as_stored = plan(&ig, &attempts, &nodes, at(10));
        let from_cache = plan(&trimmed_ig, &trimmed, &nodes, at(10));
        assert_eq!(from_cache, as_stored);
        assert!(!as_stored.events.is_empty(), "the outcomes were read");
        assert_eq!(
            plan(&trimmed_ig, &compacted(&trimmed), &nodes, at(10)),
            as_stored,
            "the index's compact entries plan alike"
        );

        // The records the plan wrote stay through the trim; other
        // annotations go.
        assert!(!as_stored.records.is_empty(), "the outcomes are recorded");
        for write in &as_stored.records {
            assert!(
                write.write_onto(&mut attempts),
                "a record goes onto an attempt of the plan"
            );
        }
        for attempt in attempts.iter_mut() {
            attempt
                .metadata
                .annotations
                .get_or_insert_default()
                .insert("example.com/note".to_string(), "x".repeat(1000));
        }
        let mut trimmed = attempts.clone();
        trimmed.iter_mut().for_each(trim_attempt);
        assert!(trimmed.iter().all(|a| {
            a.metadata
                .annotations
                .as_ref()
                .is_none_or(|kept| kept.keys().eq([ANNOTATION_RECORD]))
        }));

        // And a new build's attempts are built from the IG, not the cache.
        ig.spec = rich_ig("b2").spec;
        ig.status = Some(as_stored.status.clone());
        trimmed_ig.spec = ig.spec.clone();
        trimmed_ig.status = ig.status.clone();
        let as_stored = plan(&ig, &attempts, &nodes, at(20));
        let from_cache = plan(&trimmed_ig, &trimmed, &nodes, at(20));
        assert!(!as_stored.create.is_empty(), "b2 is issued");
        assert_eq!(from_cache, as_stored);
        assert_eq!(
            plan(&trimmed_ig, &compacted(&trimmed), &nodes, at(20)),
            as_stored
        );
    }

    /// `attempts` through the index's compact entries and back.
    fn compacted(attempts: &[SwapAttempt]) -> Vec<SwapAttempt> {
        attempts
            .iter()
            .map(|a| CachedAttempt::of(a).to_attempt("apps"))
            .collect()
    }

    #[test]
    fn a_compact_entry_gives_back_what_trimming_keeps_but_labels_and_owners() {
        let nodes = [fleet_node("n0")];
        let ig = rich_ig("b1");
        let mut attempt = plan(&ig, &[] as &[SwapAttempt], &nodes, at(0)).create[0].clone();
        attempt.metadata.uid = Some("a-1".into());
        attempt.metadata.resource_version = Some("7".into());
        attempt.metadata.creation_timestamp = Some(Time(at(1)));
        attempt.metadata.annotations = Some([(ANNOTATION_RECORD.to_string(), "{}".into())].into());
        let serving = ServingStatus {
            state: ServingState::Running,
            generation: 1,
            restarts: 0,
            last_exit: None,
            restart_at: None,
            message: None,
            listeners: Vec::new(),
            sidecars: Vec::new(),
        };
        finish(&mut attempt, Outcome::Done, Some(serving));
        if let Some(status) = attempt.status.as_mut() {
            status.effective_mode = Some(genswap_crds::Mode::Hold);
            status.clean_exit = Some(false);
            status.drain_ms = Some(12);
        }
        trim_attempt(&mut attempt);
        assert!(attempt.metadata.labels.is_some() && attempt.metadata.owner_references.is_some());

        let back = CachedAttempt::of(&attempt).to_attempt("apps");
        let mut expected = attempt;
        expected.metadata.labels = None;
        expected.metadata.owner_references = None;
        expected.metadata.uid = None;
        expected.metadata.resource_version = None;
        assert_eq!(back, expected);
    }

    #[test]
    fn trimming_keeps_name_and_labels_only() {
        let mut node = Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                labels: Some(BTreeMap::from([("zone".into(), "a".into())])),
                annotations: Some(BTreeMap::from([("big".into(), "x".repeat(4096))])),
                ..ObjectMeta::default()
            },
            status: Some(NodeStatus {
                images: Some(vec![ContainerImage::default(); 50]),
                ..NodeStatus::default()
            }),
            ..Node::default()
        };
        trim_node(&mut node);
        assert_eq!(node.metadata.name.as_deref(), Some("n1"));
        assert_eq!(node.labels().get("zone").map(String::as_str), Some("a"));
        assert!(node.metadata.annotations.is_none());
        assert!(node.status.is_none());
    }
}
