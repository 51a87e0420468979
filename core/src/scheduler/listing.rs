//! The bounded part of the status: counts of the selected nodes, and at
//! most [`NODES_LISTED`] node entries and failure-book entries (fewer when
//! their text is long: each list has a byte budget), those that need
//! attention first. What a DaemonSet's status is to its pods.

use std::collections::{BTreeMap, BTreeSet};

use genswap_crds::{HeldDown, InstanceGenerationStatus, NODES_LISTED, NodeCounts, NodeGeneration};

use super::rollout::Progress;
use super::{NodeSlot, cut};

/// At most this many bytes of a listed `attention` or reason: the agent's
/// reasons are free text.
const TEXT_BYTES: usize = 256;

/// The JSON bytes `status.nodes` and `status.heldDown` may take. With the
/// conditions (each message cut to [`super::conditions::MESSAGE_BYTES`]),
/// five history entries and the desired state, the status stays under
/// 64 KiB whatever the fleet.
const NODES_BYTES: usize = 38 * 1024;
const HELD_DOWN_BYTES: usize = 13 * 1024;

pub(super) struct List {
    counts: NodeCounts,
    nodes: Vec<NodeGeneration>,
    held_down: Vec<HeldDown>,
}

impl List {
    /// `carried`: the nodes whose book entries their record holds; the
    /// others are listed first, since the status is all that holds them.
    pub(super) fn new(
        slots: &[NodeSlot<'_>],
        progress: &Progress<'_>,
        mut book: Vec<HeldDown>,
        carried: &BTreeSet<&str>,
        staged: usize,
    ) -> Self {
        let attention = attention(progress, &book);
        let first = slots
            .iter()
            .filter(|slot| attention.contains_key(slot.name));
        let then = slots
            .iter()
            .filter(|slot| !attention.contains_key(slot.name));
        let mut nodes = within(
            first.chain(then).map(|slot| {
                let mut entry = slot.entry.clone();
                entry.attention = attention.get(slot.name).map(|why| cut(why, TEXT_BYTES));
                if let Some(last) = entry.last_attempt.as_mut() {
                    last.reason = cut(&last.reason, TEXT_BYTES);
                }
                entry
            }),
            NODES_BYTES,
        );
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        let held_total = book.len();
        book.sort_by_key(|entry| carried.contains(entry.node.as_str()));
        let book = within(
            book.into_iter().map(|mut entry| {
                entry.reason = cut(&entry.reason, TEXT_BYTES);
                entry
            }),
            HELD_DOWN_BYTES,
        );
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        Self {
            counts: NodeCounts {
                selected: count(progress.selected),
                updated: count(progress.ready + progress.down_between.len()),
                ready: count(progress.ready),
                in_flight: count(progress.in_flight),
                waiting: count(progress.waiting),
                stalled: count(progress.stalled.len()),
                held_down: count(held_total),
                attention: count(attention.len()),
                staged: count(staged),
            },
            nodes,
            held_down: book,
        }
    }

    pub(super) fn write(self, status: &mut InstanceGenerationStatus) {
        status.counts = Some(self.counts);
        status.nodes = self.nodes;
        status.held_down = self.held_down;
    }
}

/// Why each node that needs attention does: the first that applies.
fn attention<'a>(progress: &Progress<'a>, book: &[HeldDown]) -> BTreeMap<&'a str, String> {
    let mut why: BTreeMap<&str, String> = BTreeMap::new();
    // The newest booking per node (the book is in booking order).
    let newest: BTreeMap<&str, &HeldDown> = book.iter().map(|e| (e.node.as_str(), e)).collect();
    let own_failure = |node: &str| {
        newest
            .get(node)
            .map(|entry| format!("build {} failed here: {}", entry.build, entry.reason))
    };
    for &node in &progress.down {
        why.entry(node).or_insert_with(|| {
            own_failure(node).map_or_else(
                || "down, nothing serves".to_string(),
                |failed| format!("down, nothing serves; {failed}"),
            )
        });
    }
    for &node in &progress.stalled {
        why.entry(node).or_insert_with(|| {
            own_failure(node).unwrap_or_else(|| "held down: the build failed elsewhere".into())
        });
    }
    for (node, down) in &progress.down_between {
        why.entry(node)
            .or_insert_with(|| format!("down between attempts: {}", down.message()));
    }
    for (node, reason) in &progress.refused {
        why.entry(node)
            .or_insert_with(|| format!("attempts refused: {reason}"));
    }
    for (node, how) in &progress.sidecars_down {
        why.entry(node)
            .or_insert_with(|| format!("sidecar down: {how}"));
    }
    why
}

/// The first entries, at most [`NODES_LISTED`], whose JSON fits in `budget`.
fn within<T: serde::Serialize>(entries: impl Iterator<Item = T>, budget: usize) -> Vec<T> {
    let mut left = budget;
    let mut kept = Vec::new();
    for entry in entries.take(NODES_LISTED) {
        let bytes = serde_json::to_vec(&entry).map_or(usize::MAX, |json| json.len() + 1);
        if bytes > left {
            break;
        }
        left -= bytes;
        kept.push(entry);
    }
    kept
}
