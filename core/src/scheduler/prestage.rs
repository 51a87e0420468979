//! Pre-staging (SPEC 5.15, `rollout.prestage`): before the first swap of a
//! new build, every selected node that serves another build stages it
//! (fetch, verify, unpack into its store), so no wave waits on a download
//! and a registry that goes down mid-rollout leaves no node half released.
//!
//! The ask is a `stageOnly` SwapAttempt per node: it travels the node's
//! inbox like any attempt, takes a revision from the same issuer, and the
//! agent reports on it (`status.stage` while bytes flow, an outcome at the
//! end) through the same status writes. The scheduler keeps it apart from
//! the node's swap attempts: it carries no record, starts nothing and
//! supersedes nothing.
//!
//! The gate opens when every node that needs the build holds it, or once
//! the rollout of the build has begun anywhere (an attempt of it exists,
//! or a node serves it): a node joining later stages inside its swap. A
//! node that runs nothing of the instance (an install) is not asked: there
//! is nothing serving to keep up while it downloads. What the gate decides
//! is read from the attempts and the status, so a new leader resumes it.
//!
//! A stage attempt the node finished goes with the node's next swap
//! attempt (the inbox write that adds the one removes the other), with a
//! newer build, or when its node is no longer selected.

use std::collections::BTreeMap;
use std::time::Duration;

use genswap_crds::{
    DesiredState, NODES_LISTED, Outcome, PrestageStatus, StagingNode, StagingState, SwapAttempt,
};

use super::rollout::abandoned_run_backoff;
use super::{ABANDONED_RUN_KEPT, Context, NodeSlot, cut};

/// At most this many bytes of a listed node's reason.
const REASON_BYTES: usize = 256;

/// What pre-staging decided for one plan.
#[derive(Debug, Default)]
pub(super) struct Prestage<'a> {
    /// Attempts toward the desired build wait for it.
    pub closed: bool,
    /// Slots (indices) to send a stage-only attempt now.
    pub issue: Vec<usize>,
    /// Stage attempts no longer needed.
    pub delete: Vec<String>,
    /// Selected nodes that hold the desired build: serve it or staged it.
    pub staged: usize,
    /// The record for `status.rollout.prestage`.
    pub status: Option<PrestageStatus>,
    /// Nodes that cannot stage it, with why, in node order.
    pub failing: Vec<(&'a str, String)>,
    /// Seconds since pre-staging began, once past
    /// `rollout.prestageDeadlineSeconds` with the gate still closed.
    pub deadline_exceeded: Option<i64>,
    /// When to plan again: an abandoned stage's backoff, or the deadline.
    pub requeue_after: Option<Duration>,
}

/// Whether an attempt asks to stage the build without swapping.
pub(super) fn is_stage_only(attempt: &SwapAttempt) -> bool {
    attempt.spec.stage_only
}

/// `retry_changed`: `spec.retry` moved in this plan, which asks a node
/// whose stage failed for the build's fault to try once more.
pub(super) fn observe<'a>(
    ctx: &Context<'_>,
    slots: &[NodeSlot<'a>],
    stage_attempts: &[&'a SwapAttempt],
    retry_changed: bool,
) -> Prestage<'a> {
    let desired = &ctx.desired;
    let now_ms = ctx.now.0.as_millisecond();
    let mut by_node: BTreeMap<&str, Vec<&SwapAttempt>> = BTreeMap::new();
    for attempt in stage_attempts {
        by_node
            .entry(attempt.spec.node_name.as_str())
            .or_default()
            .push(attempt);
    }
    for attempts in by_node.values_mut() {
        attempts.sort_by_key(|a| a.spec.sched_rev);
    }

    let mut out = Prestage::default();
    let previous = ctx
        .previous_rollout
        .and_then(|rollout| rollout.prestage.as_ref())
        .filter(|p| {
            p.build == desired.build && p.sha256.as_deref().is_none_or(|sha| sha == desired.sha256)
        });
    // Once every node held it the record stays as it was then, while the
    // asks go one by one with the swaps that follow.
    let finished = previous.is_some_and(|p| p.done_at.is_some());
    let begun = slots
        .iter()
        .any(|slot| holds(slot, desired) || slot.attempts.iter().any(|a| builds(a, desired)));
    let on = ctx.spec.rollout.prestage && !begun;

    // Stage attempts of nodes no longer selected.
    let selected: std::collections::BTreeSet<&str> = slots.iter().map(|s| s.name).collect();
    for (node, attempts) in &by_node {
        if !selected.contains(node) {
            out.delete
                .extend(attempts.iter().filter_map(|a| a.metadata.name.clone()));
        }
    }

    let mut listed: Vec<StagingNode> = Vec::new();
    let mut fetched = 0i64;
    let mut needed = 0usize;
    let mut staged_ahead = 0usize;
    let mut earliest_due: Option<i64> = None;
    for (index, slot) in slots.iter().enumerate() {
        let mine = by_node
            .get(slot.name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let newest_swap = slot.attempts.iter().map(|a| a.spec.sched_rev).max();
        for attempt in mine {
            // Gone with a newer build, or with the node's next swap attempt.
            let superseded = !builds(attempt, desired)
                || newest_swap.is_some_and(|rev| rev > attempt.spec.sched_rev)
                || !ctx.spec.rollout.prestage;
            if superseded {
                out.delete.extend(attempt.metadata.name.clone());
            }
        }
        let swapping_to_it = finished && slot.attempts.last().is_some_and(|a| builds(a, desired));
        if holds(slot, desired) || swapping_to_it {
            out.staged += 1;
            continue;
        }
        let toward: Vec<&SwapAttempt> = mine
            .iter()
            .copied()
            .filter(|a| builds(a, desired))
            .collect();
        fetched = fetched.saturating_add(
            toward
                .iter()
                .filter_map(|a| a.status.as_ref()?.stage)
                .map(|stage| stage.fetched_bytes)
                .sum(),
        );
        if toward
            .last()
            .is_some_and(|a| outcome(a) == Some(Outcome::Done))
        {
            out.staged += 1;
            staged_ahead += 1;
            continue;
        }
        // A node that runs nothing installs: nothing serving waits on it.
        if !on || slot.entry.build.is_none() {
            continue;
        }
        needed += 1;
        let mut node = StagingNode {
            name: slot.name.to_string(),
            ..StagingNode::default()
        };
        match toward.last() {
            None => out.issue.push(index),
            Some(newest) => {
                let status = newest.status.as_ref();
                if let Some(stage) = status.and_then(|s| s.stage) {
                    node.fetched_bytes = stage.fetched_bytes;
                    node.total_bytes = stage.total_bytes;
                }
                node.reason = status
                    .and_then(|s| s.reason.as_deref())
                    .filter(|r| !r.is_empty())
                    .map(|r| cut(r, REASON_BYTES));
                match outcome(newest) {
                    None => {
                        node.state = if status.is_some_and(|s| s.stage.is_some()) {
                            StagingState::Staging
                        } else {
                            StagingState::Waiting
                        };
                    }
                    Some(Outcome::Abandoned) => {
                        node.state = StagingState::Abandoned;
                        let due = abandoned_run_backoff(&toward, |_| true);
                        if due.is_none_or(|due| due <= now_ms) {
                            out.issue.push(index);
                        } else if let Some(due) = due {
                            earliest_due = Some(earliest_due.map_or(due, |e| e.min(due)));
                        }
                    }
                    Some(_) => {
                        node.state = StagingState::Failed;
                        if retry_changed {
                            out.issue.push(index);
                        }
                    }
                }
                // The trailing run of abandoned ones paces the backoff;
                // older ones are history.
                let run = toward
                    .iter()
                    .rev()
                    .take_while(|a| outcome(a) == Some(Outcome::Abandoned))
                    .count()
                    .min(ABANDONED_RUN_KEPT);
                let keep_from = toward.len() - run.max(1);
                out.delete.extend(
                    toward[..keep_from]
                        .iter()
                        .filter(|a| outcome(a).is_some())
                        .filter_map(|a| a.metadata.name.clone()),
                );
            }
        }
        if matches!(node.state, StagingState::Failed | StagingState::Abandoned) {
            out.failing.push((
                slot.name,
                node.reason
                    .clone()
                    .unwrap_or_else(|| node.state.as_str().into()),
            ));
        }
        listed.push(node);
    }
    out.delete.sort();
    out.delete.dedup();

    if finished || (needed == 0 && staged_ahead == 0) {
        // Nothing staged ahead for this build: the record of an earlier
        // one, or of this one's finished pre-staging, stays as it was.
        out.status = previous.cloned();
        return out;
    }
    out.closed = on && needed > 0;
    let since = previous.map_or_else(|| ctx.now.clone(), |p| p.since.clone());
    let done_at = if out.closed {
        None
    } else {
        previous
            .and_then(|p| p.done_at.clone())
            .or_else(|| Some(ctx.now.clone()))
    };
    if out.closed {
        let deadline_ms = ctx
            .spec
            .rollout
            .prestage_deadline_seconds
            .max(1)
            .saturating_mul(1000);
        let waited = now_ms.saturating_sub(since.0.as_millisecond());
        if waited > deadline_ms {
            out.deadline_exceeded = Some(waited / 1000);
        } else {
            let due = now_ms + (deadline_ms - waited) + 1;
            earliest_due = Some(earliest_due.map_or(due, |e| e.min(due)));
        }
    }
    // Those that cannot stage first, then the rest by name.
    listed
        .sort_by_key(|node| !matches!(node.state, StagingState::Failed | StagingState::Abandoned));
    listed.truncate(NODES_LISTED);
    listed.sort_by(|a, b| a.name.cmp(&b.name));
    let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    out.status = Some(PrestageStatus {
        build: desired.build.clone(),
        sha256: Some(desired.sha256.clone()),
        since,
        done_at,
        staged: count(staged_ahead),
        needed: count(needed + staged_ahead),
        fetched_bytes: fetched,
        nodes: listed,
    });
    out.requeue_after =
        earliest_due.map(|due| Duration::from_millis(u64::try_from(due - now_ms).unwrap_or(0)));
    out
}

/// The node serves the desired build, whatever its config or restart: it
/// has the bytes, which is all pre-staging is about. Unlike
/// `rollout::serves`, which decides whether the node still needs a swap.
pub(super) fn holds(slot: &NodeSlot<'_>, desired: &DesiredState) -> bool {
    slot.entry.build.as_deref() == Some(desired.build.as_str())
        && slot.entry.sha256.as_deref() == Some(desired.sha256.as_str())
}

/// The attempt carries the desired build.
fn builds(attempt: &SwapAttempt, desired: &DesiredState) -> bool {
    attempt.spec.build.id == desired.build && attempt.spec.build.sha256 == desired.sha256
}

fn outcome(attempt: &SwapAttempt) -> Option<Outcome> {
    attempt.status.as_ref().and_then(|s| s.outcome)
}
