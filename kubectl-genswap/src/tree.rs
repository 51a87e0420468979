//! What `kubectl genswap get` shows, built from the InstanceGeneration and
//! its SwapAttempts alone: no client, no clock of its own.
//!
//! A node's entry is its record on its attempts (what the controller
//! remembers of it); a node without one shows as `status.nodes` lists it.
//! The status lists at most 100 nodes, so on a fleet the attempts are
//! what shows every node.

use std::collections::BTreeMap;

use genswap_crds::{
    InstanceGeneration, NodeCounts, NodeGeneration, NodeRecord, RolloutStatus, SwapAttempt,
    describe_exit,
};
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

/// How many attempts per node are shown, newest first (at rest the
/// controller keeps one).
pub const ATTEMPTS_SHOWN: usize = 3;

/// One InstanceGeneration and what runs for it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Tree {
    pub namespace: String,
    pub name: String,
    /// The build the spec asks for, and its sha256.
    pub build: String,
    pub sha256: String,
    /// `overlap` or `hold`, as the spec says.
    pub mode: &'static str,
    /// `ready/selected`, as the status says.
    pub ready: Option<String>,
    pub paused: bool,
    pub good_build: Option<String>,
    /// Builds of `status.history`, newest first.
    pub history: Vec<String>,
    /// How many selected nodes are where, as the status counts them.
    pub counts: Option<NodeCounts>,
    /// The rollout's wave, bake and last progress, as the status says.
    pub rollout: Option<RolloutStatus>,
    pub conditions: Vec<ConditionView>,
    pub nodes: Vec<NodeView>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionView {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
}

/// A selected node.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    pub name: String,
    /// Why the node needs a human or is not ready, as the status says.
    pub attention: Option<String>,
    /// `canary` for the first `rollout.canaryNodes` nodes, else `rest`.
    pub cohort: &'static str,
    pub build: Option<String>,
    pub generation: Option<i64>,
    /// Whether a generation of the desired state runs there now.
    pub serving: Option<bool>,
    pub restarts: i32,
    /// How the last generation exited between attempts, in words.
    pub last_exit: Option<String>,
    /// The serving generation's sidecars (SPEC 5.13).
    pub sidecars: Vec<SidecarView>,
    /// Newest first.
    pub attempts: Vec<AttemptView>,
}

/// A sidecar of a node's serving generation.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SidecarView {
    pub name: String,
    /// `Starting`, `Running`, `BackOff` or `Exited`.
    pub state: &'static str,
    pub restarts: i32,
    /// How it last ended, in words.
    pub last_exit: Option<String>,
    /// Why it is not running.
    pub message: Option<String>,
}

/// One SwapAttempt.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AttemptView {
    pub name: String,
    pub sched_rev: i64,
    pub cause: String,
    /// The mode that ran (or runs); the spec's until the agent says.
    pub mode: &'static str,
    /// `running` until the agent reports an outcome.
    pub outcome: String,
    pub reason: String,
    pub executed: Option<bool>,
    pub drain_ms: Option<i64>,
    /// Since the attempt was created, as kubectl prints ages.
    pub age: String,
}

/// The tree of `ig` and `attempts` (any order; others' are ignored) at
/// `now`, of every node or of `only` that one.
pub fn build(
    ig: &InstanceGeneration,
    attempts: &[SwapAttempt],
    only: Option<&str>,
    now: Timestamp,
) -> Tree {
    let spec = &ig.spec;
    let status = ig.status.clone().unwrap_or_default();
    let name = ig.metadata.name.clone().unwrap_or_default();
    let mut ours: Vec<&SwapAttempt> = attempts
        .iter()
        .filter(|a| a.spec.instance == name)
        .collect();
    ours.sort_by_key(|a| std::cmp::Reverse(a.spec.sched_rev));
    // Listed entries first, then each node's record (newest attempt first)
    // over them; the status's `attention` stays.
    let mut entries: BTreeMap<String, NodeGeneration> = status
        .nodes
        .iter()
        .map(|entry| (entry.name.clone(), entry.clone()))
        .collect();
    let mut recorded = std::collections::BTreeSet::new();
    for attempt in &ours {
        let node = &attempt.spec.node_name;
        if recorded.contains(node) {
            continue;
        }
        if let Some(record) = NodeRecord::on(attempt, node) {
            let attention = entries.get(node).and_then(|e| e.attention.clone());
            let mut entry = record.node;
            entry.attention = attention;
            entries.insert(node.clone(), entry);
            recorded.insert(node.clone());
        }
    }
    let selected = status.counts.as_ref().map_or(entries.len(), |counts| {
        usize::try_from(counts.selected).unwrap_or(0)
    });
    let canaries = spec.rollout.canaries(selected);
    let nodes = entries
        .values()
        .enumerate()
        .filter(|(_, entry)| only.is_none_or(|node| entry.name == node))
        .map(|(index, entry)| node_view(entry, index < canaries, &ours, now))
        .collect();
    Tree {
        namespace: ig.metadata.namespace.clone().unwrap_or_default(),
        name,
        build: spec.build.id.clone(),
        sha256: spec.build.sha256.clone(),
        mode: spec.mode.as_str(),
        ready: status.ready.clone(),
        paused: spec.rollout.paused,
        good_build: status.good_build.clone(),
        history: status.history.iter().map(|h| h.build.clone()).collect(),
        counts: status.counts.clone(),
        rollout: status.rollout.clone(),
        conditions: status
            .conditions
            .iter()
            .map(|c| ConditionView {
                type_: c.type_.clone(),
                status: c.status.clone(),
                reason: c.reason.clone(),
                message: c.message.clone(),
            })
            .collect(),
        nodes,
    }
}

fn node_view(
    entry: &NodeGeneration,
    canary: bool,
    attempts: &[&SwapAttempt],
    now: Timestamp,
) -> NodeView {
    NodeView {
        name: entry.name.clone(),
        attention: entry.attention.clone(),
        cohort: if canary { "canary" } else { "rest" },
        build: entry.build.clone(),
        generation: entry.generation,
        serving: entry.serving,
        restarts: entry.restarts.unwrap_or(0),
        last_exit: entry.last_exit.as_ref().map(|exit| {
            format!(
                "generation {} {}",
                exit.generation,
                describe_exit(exit.exit_code, exit.signal, exit.oom_killed)
            )
        }),
        sidecars: entry
            .sidecars
            .iter()
            .map(|sidecar| SidecarView {
                name: sidecar.name.clone(),
                state: sidecar.state.as_str(),
                restarts: sidecar.restarts,
                last_exit: sidecar
                    .last_exit
                    .as_ref()
                    .map(|exit| describe_exit(exit.exit_code, exit.signal, false)),
                message: sidecar.message.clone(),
            })
            .collect(),
        attempts: attempts
            .iter()
            .filter(|a| a.spec.node_name == entry.name)
            .take(ATTEMPTS_SHOWN)
            .map(|a| attempt_view(a, now))
            .collect(),
    }
}

fn attempt_view(attempt: &SwapAttempt, now: Timestamp) -> AttemptView {
    let status = attempt.status.as_ref();
    let mode = status
        .and_then(|s| s.effective_mode)
        .unwrap_or(attempt.spec.mode);
    AttemptView {
        name: attempt.metadata.name.clone().unwrap_or_default(),
        sched_rev: attempt.spec.sched_rev,
        // A stage-only attempt swaps nothing: it has no mode to show.
        cause: if attempt.spec.stage_only {
            "prestage".to_string()
        } else {
            attempt.spec.cause.as_str().to_string()
        },
        mode: if attempt.spec.stage_only {
            "stage-only"
        } else {
            mode.as_str()
        },
        outcome: status
            .and_then(|s| s.outcome)
            .map_or_else(|| "running".to_string(), |o| o.as_str().to_string()),
        reason: status.and_then(|s| s.reason.clone()).unwrap_or_default(),
        executed: status.and_then(|s| s.executed),
        drain_ms: status.and_then(|s| s.drain_ms),
        age: attempt
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or_else(|| "-".to_string(), |t| age(now, t.0)),
    }
}

/// An age as kubectl prints it: `45s`, `12m`, `5h`, `3d`.
pub fn age(now: Timestamp, then: Timestamp) -> String {
    let seconds = now.as_second().saturating_sub(then.as_second()).max(0);
    match seconds {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}
