//! Which InstanceGenerations a Node event concerns.
//!
//! A Node that is added, deleted or relabelled can enter or leave an IG's
//! selection, so the IGs whose selector matches its labels before *or* after
//! the change are planned again. Events that leave the labels as they were
//! (status heartbeats, condition flips, taints) plan nothing: the scheduler
//! reads only names and labels, and a fleet's Nodes change status often.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

use crate::observe::WatchedIg;
use genswap_core::scheduler::selects;

/// A Node's labels.
pub type Labels = BTreeMap<String, String>;

/// One Node's labels before and after an event; `None` is "absent".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabelChange {
    pub node: String,
    pub before: Option<Labels>,
    pub after: Option<Labels>,
}

/// The last labels seen for every Node.
#[derive(Debug, Default)]
pub struct NodeLabelIndex {
    known: HashMap<String, Labels>,
    /// Nodes listed since the watch (re)started; replaces `known` when the
    /// list completes, so Nodes deleted while the watch was down show up as
    /// deletions.
    relisting: Option<HashMap<String, Labels>>,
}

impl NodeLabelIndex {
    /// Folds one watch event in and returns the label changes it carries.
    pub fn observe(&mut self, event: &watcher::Event<Node>) -> Vec<LabelChange> {
        match event {
            watcher::Event::Apply(node) => {
                let name = node.name_any();
                let after = node.labels().clone();
                let before = self.known.insert(name.clone(), after.clone());
                if before.as_ref() == Some(&after) {
                    Vec::new()
                } else {
                    vec![LabelChange {
                        node: name,
                        before,
                        after: Some(after),
                    }]
                }
            }
            watcher::Event::Delete(node) => {
                let name = node.name_any();
                let before = self
                    .known
                    .remove(&name)
                    .or_else(|| Some(node.labels().clone()));
                vec![LabelChange {
                    node: name,
                    before,
                    after: None,
                }]
            }
            watcher::Event::Init => {
                self.relisting = Some(HashMap::new());
                Vec::new()
            }
            watcher::Event::InitApply(node) => {
                self.relisting
                    .get_or_insert_with(HashMap::new)
                    .insert(node.name_any(), node.labels().clone());
                Vec::new()
            }
            watcher::Event::InitDone => {
                let listed = self.relisting.take().unwrap_or_default();
                let names: HashSet<&String> = self.known.keys().chain(listed.keys()).collect();
                let mut changes: Vec<LabelChange> = names
                    .into_iter()
                    .filter_map(|name| {
                        let before = self.known.get(name);
                        let after = listed.get(name);
                        (before != after).then(|| LabelChange {
                            node: name.clone(),
                            before: before.cloned(),
                            after: after.cloned(),
                        })
                    })
                    .collect();
                changes.sort_by(|a, b| a.node.cmp(&b.node));
                self.known = listed;
                changes
            }
        }
    }
}

/// The cached IGs whose selector matched a changed Node before or after.
pub fn affected(changes: &[LabelChange], igs: &Store<WatchedIg>) -> Vec<ObjectRef<WatchedIg>> {
    if changes.is_empty() {
        return Vec::new();
    }
    let mut hit = Vec::new();
    for guard in igs.state() {
        let Ok(ig) = &guard.0 else { continue };
        let selector = &ig.spec.node_selector;
        let concerned = changes.iter().any(|change| {
            [&change.before, &change.after]
                .into_iter()
                .flatten()
                .any(|labels| selects(selector, Some(labels)))
        });
        if concerned {
            hit.push(ObjectRef::from_obj(&*guard));
        }
    }
    hit
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Node::default()
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_new_node_is_a_change_and_an_unchanged_one_is_not() {
        let mut index = NodeLabelIndex::default();
        let changes = index.observe(&watcher::Event::Apply(node("n1", &[("zone", "a")])));
        assert_eq!(
            changes,
            vec![LabelChange {
                node: "n1".into(),
                before: None,
                after: Some(labels(&[("zone", "a")])),
            }]
        );
        assert!(
            index
                .observe(&watcher::Event::Apply(node("n1", &[("zone", "a")])))
                .is_empty(),
            "a status-only update re-plans nothing"
        );
    }

    #[test]
    fn a_relabel_reports_old_and_new_labels() {
        let mut index = NodeLabelIndex::default();
        index.observe(&watcher::Event::Apply(node("n1", &[("zone", "a")])));
        let changes = index.observe(&watcher::Event::Apply(node("n1", &[("zone", "b")])));
        assert_eq!(changes[0].before, Some(labels(&[("zone", "a")])));
        assert_eq!(changes[0].after, Some(labels(&[("zone", "b")])));
    }

    #[test]
    fn a_delete_reports_the_labels_it_had() {
        let mut index = NodeLabelIndex::default();
        index.observe(&watcher::Event::Apply(node("n1", &[("zone", "a")])));
        let changes = index.observe(&watcher::Event::Delete(node("n1", &[])));
        assert_eq!(changes[0].before, Some(labels(&[("zone", "a")])));
        assert_eq!(changes[0].after, None);
    }

    #[test]
    fn a_relist_reports_nodes_deleted_while_the_watch_was_down() {
        let mut index = NodeLabelIndex::default();
        index.observe(&watcher::Event::Apply(node("gone", &[("zone", "a")])));
        index.observe(&watcher::Event::Apply(node("kept", &[("zone", "a")])));
        assert!(index.observe(&watcher::Event::Init).is_empty());
        assert!(
            index
                .observe(&watcher::Event::InitApply(node("kept", &[("zone", "a")])))
                .is_empty()
        );
        let changes = index.observe(&watcher::Event::InitDone);
        assert_eq!(
            changes,
            vec![LabelChange {
                node: "gone".into(),
                before: Some(labels(&[("zone", "a")])),
                after: None,
            }]
        );
    }

    #[test]
    fn only_igs_selecting_the_node_before_or_after_are_concerned() {
        use genswap_crds::InstanceGeneration;
        use kube::core::DeserializeGuard;
        use kube::runtime::reflector;

        let ig = |name: &str, selector: serde_json::Value| -> WatchedIg {
            DeserializeGuard(Ok(serde_json::from_value::<InstanceGeneration>(serde_json::json!({
                "apiVersion": "genswap.dev/v1alpha1",
                "kind": "InstanceGeneration",
                "metadata": { "name": name, "namespace": "apps" },
                "spec": {
                    "nodeSelector": selector,
                    "build": { "id": "b", "artifact": { "path": "/b" }, "sha256": "a".repeat(64) },
                },
            }))
            .expect("fixture IG deserializes")))
        };
        let (store, mut writer) = reflector::store();
        for object in [
            ig("zone-a", serde_json::json!({ "zone": "a" })),
            ig("zone-b", serde_json::json!({ "zone": "b" })),
            ig("zone-c", serde_json::json!({ "zone": "c" })),
            ig("everywhere", serde_json::json!({})),
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(object));
        }
        let relabel = [LabelChange {
            node: "n1".into(),
            before: Some(labels(&[("zone", "a")])),
            after: Some(labels(&[("zone", "b")])),
        }];
        let mut names: Vec<String> = affected(&relabel, &store)
            .into_iter()
            .map(|object| object.name)
            .collect();
        names.sort();
        assert_eq!(names, vec!["everywhere", "zone-a", "zone-b"]);
        assert!(affected(&[], &store).is_empty());
    }
}
