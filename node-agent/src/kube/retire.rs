//! Instances whose InstanceGeneration was deleted: stopped on this node, as
//! a Deployment's pods go with it.
//!
//! Deleting an InstanceGeneration garbage-collects its SwapAttempts (they
//! carry its ownerReference). An instance that serves here but has no
//! attempt left in the synced watch cache, and none running, is therefore a
//! candidate ([`unowned`]). The cache alone is not proof: someone may have
//! deleted the attempts by hand, or the InstanceGeneration may have been
//! re-created already. So each candidate's InstanceGeneration is read from
//! the API server ([`look_up`]); only a 404, or an object already being
//! deleted, stops the instance, with the stop settings of its last attempt.
//! Anything else (the object exists, the read failed) leaves it serving.
//!
//! A node that merely left the InstanceGeneration's `nodeSelector` keeps
//! its instance: the controller deletes its attempts, but the object exists.

use std::collections::HashSet;
use std::time::Duration;

use genswap_crds::{InstanceGeneration, SwapAttempt};
use kube::api::Api;
use kube::{Client, ResourceExt};

use crate::gate::InstanceKey;

/// Whether an instance's InstanceGeneration still exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// 404, or being deleted: the instance is not wanted anywhere.
    Gone,
    /// It exists: keep serving.
    Present,
    /// The read failed; nothing can be concluded.
    Unknown(String),
}

/// How long the read of an InstanceGeneration may take.
pub const LOOK_UP_TIMEOUT: Duration = Duration::from_secs(10);

/// The serving instances no cached attempt of this node names and none
/// running: the ones whose InstanceGeneration may be gone.
pub fn unowned<'a>(
    serving: &[InstanceKey],
    cached: impl IntoIterator<Item = &'a SwapAttempt>,
    busy: impl Fn(&InstanceKey) -> bool,
) -> Vec<InstanceKey> {
    let named: HashSet<InstanceKey> = cached
        .into_iter()
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

/// Reads `instance`'s InstanceGeneration from the API server (never from a
/// cache: a stale one could stop an instance that is wanted).
pub async fn look_up(client: &Client, instance: &InstanceKey) -> Owner {
    let api: Api<InstanceGeneration> = Api::namespaced(client.clone(), instance.namespace());
    match tokio::time::timeout(LOOK_UP_TIMEOUT, api.get_opt(instance.name())).await {
        Err(_) => Owner::Unknown(format!(
            "reading the InstanceGeneration took over {LOOK_UP_TIMEOUT:?}"
        )),
        Ok(Err(error)) => Owner::Unknown(error.to_string()),
        Ok(Ok(None)) => Owner::Gone,
        Ok(Ok(Some(ig))) if ig.metadata.deletion_timestamp.is_some() => Owner::Gone,
        Ok(Ok(Some(_))) => Owner::Present,
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
    fn nothing_serving_means_nothing_to_retire() {
        let cached = [attempt("apps", "web")];
        assert!(unowned(&[], &cached, |_| false).is_empty());
    }
}
