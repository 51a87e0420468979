//! What each verb writes, decided without a client: a JSON merge patch of
//! the one field the verb changes, so every other field stays as it is,
//! whoever set it.
//!
//! A server-side apply would not do: an apply states every field its
//! manager owns, so one field manager shared by the verbs would drop what
//! the previous verb set (`pause` then `retry` removed `spec.rollout.paused`,
//! and after `undo` every other verb removed `spec.build`, which the schema
//! requires). A merge patch changes the fields it names and nothing else;
//! the server records them under the plugin's field manager.

use genswap_crds::{HistoryEntry, InstanceGeneration};
use serde_json::{Value, json};

use crate::error::PluginError;

/// The field manager of every write the plugin makes.
pub const FIELD_MANAGER: &str = "kubectl-genswap";

/// `spec.retry` set to `token`, which must differ from the current one.
pub fn retry(token: &str) -> Value {
    json!({"spec": {"retry": token}})
}

/// Whether `ig`'s current build is held down on some node: what a retry
/// can arm.
pub fn retryable(ig: &InstanceGeneration) -> bool {
    ig.status
        .as_ref()
        .is_some_and(|s| s.held_down.iter().any(|h| h.build == ig.spec.build.id))
}

/// `spec.rollout.paused`.
pub fn pause(paused: bool) -> Value {
    json!({"spec": {"rollout": {"paused": paused}}})
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

/// `spec.build` set back to `entry`'s build, as it was released. It carries
/// the object's `resourceVersion`: the target was chosen from the object
/// as read, so a change since then fails the write (409) instead of being
/// undone by it.
pub fn undo(ig: &InstanceGeneration, entry: &HistoryEntry) -> Value {
    // Exactly one of path, url and image: the others are removed, not left over
    // from the build being replaced.
    let artifact = json!({
        "path": entry.artifact.path,
        "url": entry.artifact.url,
        "image": entry.artifact.image,
        "unpack": entry.artifact.unpack,
    });
    json!({
        "metadata": {"resourceVersion": ig.metadata.resource_version},
        "spec": {"build": {
            "id": entry.build,
            "artifact": artifact,
            "sha256": entry.sha256,
            "entrypoint": entry.entrypoint,
        }},
    })
}

fn name(ig: &InstanceGeneration) -> &str {
    ig.metadata.name.as_deref().unwrap_or_default()
}

fn namespace(ig: &InstanceGeneration) -> &str {
    ig.metadata.namespace.as_deref().unwrap_or_default()
}
