//! The read side of a reconcile: what the Node cache holds (an IG's
//! attempts come from [`crate::attempt_index`]). No requests; the
//! reflectors keep the caches current.

use genswap_crds::InstanceGeneration;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::Store;

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
    let metadata = std::mem::take(&mut node.metadata);
    node.metadata = ObjectMeta {
        name: metadata.name,
        uid: metadata.uid,
        resource_version: metadata.resource_version,
        labels: metadata.labels,
        creation_timestamp: metadata.creation_timestamp,
        deletion_timestamp: metadata.deletion_timestamp,
        ..ObjectMeta::default()
    };
    node.status = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerImage, NodeStatus};
    use kube::ResourceExt;
    use std::collections::BTreeMap;

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
