//! What each verb writes: a server-side apply of the few fields it owns,
//! under the plugin's own field manager, decided without a client.

use genswap_crds::{HistoryEntry, InstanceGeneration};
use serde_json::{Value, json};

use crate::error::PluginError;

/// The field manager of every write the plugin makes.
pub const FIELD_MANAGER: &str = "kubectl-genswap";

/// An apply patch of `spec` fields of InstanceGeneration `namespace/name`.
pub fn apply_spec(namespace: &str, name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    })
}

/// `spec.retry` set to `token`, which must differ from the current one.
pub fn retry(ig: &InstanceGeneration, token: &str) -> Value {
    apply_spec(namespace(ig), name(ig), json!({"retry": token}))
}

/// `spec.rollout.paused`.
pub fn pause(ig: &InstanceGeneration, paused: bool) -> Value {
    apply_spec(
        namespace(ig),
        name(ig),
        json!({"rollout": {"paused": paused}}),
    )
}

/// The history entry `undo` goes back to: the one for `to_build`, or the
/// newest whose build differs from what the spec asks for now.
pub fn undo_target<'a>(
    ig: &'a InstanceGeneration,
    to_build: Option<&str>,
) -> Result<&'a HistoryEntry, PluginError> {
    let history = ig
        .status
        .as_ref()
        .map(|s| s.history.as_slice())
        .unwrap_or_default();
    let current = &ig.spec.build;
    let found = match to_build {
        Some(build) => history.iter().find(|h| h.build == build),
        None => history
            .iter()
            .find(|h| h.build != current.id || h.sha256 != current.sha256),
    };
    found.ok_or_else(|| PluginError::NoHistory {
        object: format!("{}/{}", namespace(ig), name(ig)),
        wanted: to_build.map(str::to_string),
        current: current.id.clone(),
        history: history.iter().map(|h| h.build.clone()).collect(),
    })
}

/// `spec.build` set back to `entry`'s build, as it was released.
pub fn undo(ig: &InstanceGeneration, entry: &HistoryEntry) -> Value {
    apply_spec(
        namespace(ig),
        name(ig),
        json!({"build": {"id": entry.build, "artifact": entry.artifact, "sha256": entry.sha256}}),
    )
}

fn name(ig: &InstanceGeneration) -> &str {
    ig.metadata.name.as_deref().unwrap_or_default()
}

fn namespace(ig: &InstanceGeneration) -> &str {
    ig.metadata.namespace.as_deref().unwrap_or_default()
}
