//! The Argo CD health scripts of docs/argocd/argocd-cm-health.yaml, run on
//! a Lua 5.1 VM (what Argo CD embeds) against InstanceGenerations and
//! SwapAttempts in each state the controller and the agents write; and
//! docs/DASHBOARDS.md shows exactly that file.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mlua::{Lua, LuaSerdeExt, Table};
use serde_json::{Value, json};

const IG_KEY: &str = "resource.customizations.health.genswap.dev_InstanceGeneration";
const ATTEMPT_KEY: &str = "resource.customizations.health.genswap.dev_SwapAttempt";

fn docs() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .join("docs")
}

fn scripts() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(docs().join("argocd/argocd-cm-health.yaml"))
        .expect("read docs/argocd/argocd-cm-health.yaml");
    let patch: Value = serde_saphyr::from_str(&text).expect("the argocd-cm patch is YAML");
    serde_json::from_value(patch["data"].clone()).expect("data is a map of strings")
}

/// Runs `script` with `obj` as Argo CD does; returns (status, message).
fn health(script: &str, obj: &Value) -> (String, String) {
    let lua = Lua::new();
    let value = lua.to_value(obj).expect("the object converts to Lua");
    lua.globals().set("obj", value).expect("set obj");
    let result: Table = lua
        .load(script)
        .eval()
        .unwrap_or_else(|e| panic!("the health script fails: {e}"));
    (
        result.get("status").expect("hs.status"),
        result.get("message").expect("hs.message"),
    )
}

fn ig(generation: i64, status: Value) -> Value {
    let mut object = json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {"name": "hello", "namespace": "default", "generation": generation},
        "spec": {"build": {"id": "hello-2"}},
    });
    if !status.is_null() {
        object["status"] = status;
    }
    object
}

fn condition(kind: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": kind, "status": status, "reason": reason, "message": message, "observedGeneration": 3})
}

#[test]
fn instance_generation_health_follows_the_kstatus_conditions() {
    let scripts = scripts();
    let script = scripts.get(IG_KEY).expect("the InstanceGeneration script");

    assert_eq!(health(script, &ig(1, Value::Null)).0, "Progressing");

    let ready = ig(
        3,
        json!({"observedGeneration": 3, "conditions": [
            condition("Ready", "True", "AllNodesReady", "2/2 nodes serve hello-2"),
            condition("Reconciling", "False", "AllNodesReady", ""),
            condition("Stalled", "False", "AllNodesReady", ""),
        ]}),
    );
    assert_eq!(
        health(script, &ready),
        (
            "Healthy".into(),
            "AllNodesReady: 2/2 nodes serve hello-2".into()
        )
    );

    let rolling = ig(
        3,
        json!({"observedGeneration": 3, "conditions": [
            condition("Ready", "False", "RolloutInProgress", "1/2 nodes ready"),
            condition("Reconciling", "True", "RolloutInProgress", "canary node-a in flight"),
            condition("Stalled", "False", "RolloutInProgress", ""),
        ]}),
    );
    assert_eq!(
        health(script, &rolling),
        (
            "Progressing".into(),
            "RolloutInProgress: canary node-a in flight".into()
        )
    );

    let stalled = ig(
        3,
        json!({"observedGeneration": 3, "conditions": [
            condition("Ready", "False", "BuildFailed", "hello-3 failed on node-a"),
            condition("Reconciling", "False", "BuildFailed", ""),
            condition("Stalled", "True", "BuildFailed", "hello-3 (overlap) is held down: unhealthy: 500"),
        ]}),
    );
    assert_eq!(
        health(script, &stalled),
        (
            "Degraded".into(),
            "BuildFailed: hello-3 (overlap) is held down: unhealthy: 500".into()
        )
    );

    // A status written for an older spec says nothing of this one.
    let stale = ig(
        4,
        json!({"observedGeneration": 3, "conditions": [
            condition("Ready", "True", "AllNodesReady", "2/2"),
        ]}),
    );
    assert_eq!(health(script, &stale).0, "Progressing");

    let no_nodes = ig(
        3,
        json!({"observedGeneration": 3, "conditions": [
            condition("Ready", "False", "NoMatchingNodes", "no node matches the selector"),
            condition("Reconciling", "False", "NoMatchingNodes", ""),
            condition("Stalled", "False", "NoMatchingNodes", ""),
        ]}),
    );
    assert_eq!(
        health(script, &no_nodes),
        (
            "Progressing".into(),
            "NoMatchingNodes: no node matches the selector".into()
        )
    );
}

#[test]
fn swap_attempt_health_follows_its_outcome() {
    let scripts = scripts();
    let script = scripts.get(ATTEMPT_KEY).expect("the SwapAttempt script");
    let attempt = |status: Value| {
        let mut object = json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "SwapAttempt",
            "metadata": {"name": "hello-node-a-7", "namespace": "default"},
            "spec": {"nodeName": "node-a", "schedRev": 7},
        });
        if !status.is_null() {
            object["status"] = status;
        }
        object
    };
    assert_eq!(health(script, &attempt(Value::Null)).0, "Progressing");
    assert_eq!(
        health(script, &attempt(json!({"outcome": "done"}))),
        ("Healthy".into(), "done on node-a".into())
    );
    assert_eq!(
        health(
            script,
            &attempt(json!({"outcome": "abandoned", "reason": "superseded by schedRev 8"}))
        )
        .0,
        "Healthy"
    );
    for outcome in ["failed", "down"] {
        assert_eq!(
            health(
                script,
                &attempt(json!({"outcome": outcome, "reason": "unhealthy: 500"}))
            ),
            ("Degraded".into(), format!("{outcome}: unhealthy: 500"))
        );
    }
}

#[test]
fn the_dashboards_doc_shows_the_scripts_argo_cd_gets() {
    let doc =
        std::fs::read_to_string(docs().join("DASHBOARDS.md")).expect("read docs/DASHBOARDS.md");
    let file = std::fs::read_to_string(docs().join("argocd/argocd-cm-health.yaml"))
        .expect("read the argocd-cm patch");
    assert!(
        doc.contains(&file),
        "docs/DASHBOARDS.md must quote docs/argocd/argocd-cm-health.yaml verbatim"
    );
}
