//! Objects the tests create on a control plane, written as the API server
//! takes them.

use serde_json::{Value, json};

/// A SwapAttempt `name` of instance `web` for `node` at revision
/// `sched_rev`: an install of build `b1`, with no status.
pub fn swap_attempt(name: &str, node: &str, sched_rev: i64) -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "SwapAttempt",
        "metadata": {"name": name},
        "spec": {
            "instance": "web", "nodeName": node, "schedRev": sched_rev, "cause": "install",
            "build": {"id": "b1", "artifact": {"path": "/opt/b1"}, "sha256": "a".repeat(64)},
            "mode": "overlap",
        },
    })
}
