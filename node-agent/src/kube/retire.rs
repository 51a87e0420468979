//! Instances no longer wanted on this node: stopped here, as a
//! DaemonSet's pod goes when its object is deleted or its node stops
//! matching.
//!
//! Deleting an InstanceGeneration garbage-collects its SwapAttempts (they
//! carry its ownerReference); a node that leaves its `nodeSelector` has its
//! attempts deleted by the controller. An instance that serves here but has
//! no attempt left in the synced watch cache, and none running, is therefore
//! a candidate ([`unowned`]). The cache alone is not proof: someone may have
//! deleted the attempts by hand, the InstanceGeneration may have been
//! re-created already, or the node's labels changed back. So each
//! candidate's InstanceGeneration, and then this node's Node, are read from
//! the API server ([`look_up`]). Only a 404, an object already being
//! deleted, a selector this node's labels no longer match, or a namespace
//! being deleted stops the instance, with the stop settings it was started
//! with. Anything else (the object exists and selects this node, a read
//! failed) leaves it serving, and the agent looks again later.
//!
//! The namespace matters because its deletion takes the namespace's
//! objects kind by kind: the attempts may go first, while their
//! InstanceGeneration still exists and has no deletion mark yet, and the
//! InstanceGeneration's own deletion then sends the agent no event.

use std::collections::HashSet;
use std::time::Duration;

use genswap_core::scheduler::selects;
use genswap_crds::{InstanceGeneration, SwapAttempt};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::Api;
use kube::{Client, ResourceExt};

use crate::gate::InstanceKey;

/// Whether an instance is still wanted on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// 404, being deleted, or in a namespace being deleted: the instance is
    /// not wanted anywhere. Says which, for the log.
    Gone(&'static str),
    /// It exists, but its `nodeSelector` does not match this node's labels.
    Unselected,
    /// It exists and selects this node: keep serving.
    Present,
    /// The read failed; nothing can be concluded.
    Unknown(String),
}

/// How long each read (the InstanceGeneration, the Node) may take.
pub const LOOK_UP_TIMEOUT: Duration = Duration::from_secs(10);

/// The serving instances no cached swap attempt of this node names and none
/// running: the ones whose InstanceGeneration may be gone. An ask to stage
/// ahead (`stageOnly`) owns nothing: the controller deletes a node's asks
/// and swaps in any order, so one left for a moment must not keep an
/// unwanted instance serving.
pub fn unowned<'a>(
    serving: &[InstanceKey],
    cached: impl IntoIterator<Item = &'a SwapAttempt>,
    busy: impl Fn(&InstanceKey) -> bool,
) -> Vec<InstanceKey> {
    let named: HashSet<InstanceKey> = cached
        .into_iter()
        .filter(|attempt| !attempt.spec.stage_only)
        .filter_map(|attempt| {
            InstanceKey::new(attempt.namespace()?, attempt.spec.instance.clone()).ok()
        })
        .collect();
    serving
        .iter()
        .filter(|instance| !named.contains(*instance) && !busy(instance))
        .cloned()
        .collect()
}

/// Reads `instance`'s InstanceGeneration, then `node_name`'s Node, then
/// the instance's Namespace from the API server (never from a cache: a
/// stale one could stop an instance that is wanted).
pub async fn look_up(client: &Client, instance: &InstanceKey, node_name: &str) -> Owner {
    const DELETED: &str = "its InstanceGeneration is deleted";
    let igs: Api<InstanceGeneration> = Api::namespaced(client.clone(), instance.namespace());
    let ig = match read(igs.get_opt(instance.name()), "the InstanceGeneration").await {
        Err(why) => return Owner::Unknown(why),
        Ok(None) => return Owner::Gone(DELETED),
        Ok(Some(ig)) if ig.metadata.deletion_timestamp.is_some() => return Owner::Gone(DELETED),
        Ok(Some(ig)) => ig,
    };
    let nodes: Api<Node> = Api::all(client.clone());
    match read(nodes.get_opt(node_name), "this node's Node").await {
        Err(why) => return Owner::Unknown(why),
        // A node whose object is gone is leaving the cluster; its instances
        // go with the machine, not by a guess made here.
        Ok(None) => return Owner::Unknown(format!("the Node {node_name} is not found")),
        Ok(Some(node)) if selects(&ig.spec.node_selector, node.metadata.labels.as_ref()) => {}
        Ok(Some(_)) => return Owner::Unselected,
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    match read(namespaces.get_opt(instance.namespace()), "its Namespace").await {
        Ok(Some(namespace)) if namespace.metadata.deletion_timestamp.is_some() => {
            Owner::Gone("its namespace is being deleted")
        }
        // An agent whose RBAC predates the Namespace read still keeps what
        // its InstanceGeneration wants; it looks again on its timer.
        Err(why) => {
            tracing::debug!(%instance, %why, "its Namespace could not be read");
            Owner::Present
        }
        Ok(_) => Owner::Present,
    }
}

/// One read with [`LOOK_UP_TIMEOUT`]; the error says what was read.
async fn read<T>(
    request: impl Future<Output = kube::Result<Option<T>>>,
    what: &str,
) -> Result<Option<T>, String> {
    match tokio::time::timeout(LOOK_UP_TIMEOUT, request).await {
        Err(_) => Err(format!("reading {what} took over {LOOK_UP_TIMEOUT:?}")),
        Ok(Err(error)) => Err(format!("reading {what}: {error}")),
        Ok(Ok(object)) => Ok(object),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use genswap_crds::SwapAttemptSpec;
    use kube::api::ObjectMeta;

    fn key(name: &str) -> InstanceKey {
        InstanceKey::new("apps", name).expect("valid key")
    }

    fn attempt(namespace: &str, instance: &str) -> SwapAttempt {
        let spec: SwapAttemptSpec = serde_json::from_value(serde_json::json!({
            "instance": instance,
            "nodeName": "node-a",
            "schedRev": 1,
            "cause": "install",
            "build": { "id": "b1", "artifact": { "path": "/opt/b1" }, "sha256": "a".repeat(64) },
            "mode": "overlap",
        }))
        .expect("spec deserializes");
        SwapAttempt {
            metadata: ObjectMeta {
                name: Some(format!("{instance}-node-a-1")),
                namespace: Some(namespace.into()),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        }
    }

    #[test]
    fn only_serving_instances_without_attempts_or_a_run_are_candidates() {
        let serving = [key("web"), key("api"), key("batch"), key("cron")];
        let cached = [attempt("apps", "web"), attempt("other", "api")];
        let candidates = unowned(&serving, &cached, |instance| instance.name() == "batch");
        // web has an attempt; api's is in another namespace; batch is busy.
        assert_eq!(candidates, [key("api"), key("cron")]);
    }

    #[test]
    fn an_ask_to_stage_ahead_does_not_keep_an_instance() {
        let serving = [key("web"), key("api")];
        let mut ask = attempt("apps", "web");
        ask.spec.stage_only = true;
        let cached = [ask, attempt("apps", "api")];
        assert_eq!(unowned(&serving, &cached, |_| false), [key("web")]);
    }

    #[test]
    fn nothing_serving_means_nothing_to_retire() {
        let cached = [attempt("apps", "web")];
        assert!(unowned(&[], &cached, |_| false).is_empty());
    }
}
