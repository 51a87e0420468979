//! Node records: what the controller remembers of each node (the entry
//! `status.nodes` used to hold for every node, and the node's entries of
//! the failure book), kept on the node's newest finished SwapAttempt so the
//! InstanceGeneration's status stays bounded and older attempts can go.
//!
//! The carrier is the newest `done` or `down` attempt: the agent reports
//! the serving generation on the `done` one that installed it, so that one
//! stays anyway, and a `down` ends its lineage. A node that never had
//! either carries its record on its newest finished attempt. Once the cache
//! shows a record, every finished attempt whose outcome it holds goes
//! ([`super::rollout::expired`]); at rest a node keeps one attempt, and
//! beside it its newest when that one failed.

use std::collections::{BTreeMap, BTreeSet};

use genswap_crds::{HeldDown, NodeRecord, Outcome, SwapAttempt};

use super::{NodeSlot, RecordWrite};

/// The failure book as the records hold it, plus the listed entries of
/// nodes without a record (a status written before records, or a node
/// whose attempts are gone), oldest booking first.
pub(super) fn book_entries(slots: &[NodeSlot<'_>], listed: Vec<HeldDown>) -> Vec<HeldDown> {
    let recorded: BTreeSet<&str> = slots
        .iter()
        .filter(|slot| slot.recorded.is_some())
        .map(|slot| slot.name)
        .collect();
    let mut entries: Vec<HeldDown> = listed
        .into_iter()
        .filter(|entry| !recorded.contains(entry.node.as_str()))
        .collect();
    for slot in slots {
        if let Some((_, record)) = &slot.recorded {
            entries.extend(
                record
                    .held_down
                    .iter()
                    .filter(|entry| entry.node == slot.name)
                    .cloned(),
            );
        }
    }
    entries.sort_by_key(|entry| entry.since.0);
    entries
}

/// The attempt that carries a node's record.
pub(super) fn carrier<'a>(attempts: &[&'a SwapAttempt]) -> Option<&'a SwapAttempt> {
    let outcome = |a: &SwapAttempt| a.status.as_ref().and_then(|s| s.outcome);
    let ends_lineage =
        |a: &&&SwapAttempt| matches!(outcome(a), Some(Outcome::Done | Outcome::Down));
    attempts
        .iter()
        .rev()
        .find(ends_lineage)
        .or_else(|| attempts.iter().rev().find(|a| outcome(a).is_some()))
        .copied()
}

/// The records that changed (or moved to a newer carrier), and the nodes
/// whose record has a carrier: their book entries live there.
pub(super) fn writes<'s>(
    slots: &[NodeSlot<'s>],
    book: &[HeldDown],
) -> (Vec<RecordWrite>, BTreeSet<&'s str>) {
    let mut held: BTreeMap<&str, Vec<&HeldDown>> = BTreeMap::new();
    for entry in book {
        held.entry(entry.node.as_str()).or_default().push(entry);
    }
    let mut writes = Vec::new();
    let mut carried = BTreeSet::new();
    for slot in slots {
        let Some(carrier) = carrier(slot.attempts) else {
            continue;
        };
        let Some(name) = carrier.metadata.name.as_deref() else {
            continue;
        };
        carried.insert(slot.name);
        let record = NodeRecord {
            node: slot.entry.clone(),
            held_down: held
                .get(slot.name)
                .map(|entries| entries.iter().map(|&e| e.clone()).collect())
                .unwrap_or_default(),
        };
        let unchanged = slot
            .recorded
            .as_ref()
            .is_some_and(|(on, read)| on.metadata.name.as_deref() == Some(name) && *read == record);
        if unchanged {
            continue;
        }
        let recorded_before = slot.last_before;
        let new_outcome = record
            .node
            .last_attempt
            .as_ref()
            .filter(|last| recorded_before != Some((last.sched_rev, last.outcome)))
            .map(|last| (last.outcome, last.mode));
        writes.push(RecordWrite {
            attempt: name.to_string(),
            record,
            new_outcome,
        });
    }
    (writes, carried)
}
