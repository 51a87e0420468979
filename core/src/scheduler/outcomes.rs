//! Reads the outcomes the status has not recorded yet into the node entry
//! and the failure book, with one Event each.
//!
//! "Not recorded yet" means a schedRev above the node's
//! `lastAttempt.schedRev`: the status write that records an outcome is the
//! same write that moves that mark, so every outcome is read, and its Event
//! asked for, exactly once. One exception keeps the serving state true: a
//! `done` reported late, below the mark, still updates the node when it
//! started a newer generation than the one recorded (the generation number
//! then moves the mark).

use genswap_crds::{Cause, LastAttempt, NodeGeneration, Outcome, SwapAttempt, SwapAttemptStatus};

use super::failure_book::{Failure, FailureBook};
use super::rollout::effective_mode_of;
use super::{Context, NodeSlot, PlanEvent};

pub(super) fn observe(
    slot: &mut NodeSlot<'_>,
    book: &mut FailureBook,
    ctx: &Context<'_>,
    events: &mut Vec<PlanEvent>,
) {
    let NodeSlot {
        name: node,
        attempts,
        entry,
        ..
    } = slot;
    let recorded = entry.last_attempt.as_ref().map_or(0, |l| l.sched_rev);
    for (index, attempt) in attempts.iter().enumerate() {
        let Some(status) = attempt.status.as_ref() else {
            continue;
        };
        let Some(outcome) = status.outcome else {
            continue;
        };
        let rev = attempt.spec.sched_rev;
        let mode = status
            .effective_mode
            .unwrap_or_else(|| effective_mode_of(&attempt.spec));
        let build = attempt.spec.build.id.as_str();
        let since = status
            .finished_at
            .clone()
            .unwrap_or_else(|| ctx.now.clone());
        if rev <= recorded {
            if outcome == Outcome::Done && starts_newer_generation(status, entry) {
                serve(entry, attempt, status, since);
                events.push(done_event(node, attempt, status, mode));
            }
            continue;
        }
        let reason = status.reason.clone().unwrap_or_default();
        let executed = status.executed.unwrap_or(true);
        let was_retry = attempt.spec.cause == Cause::Retry;
        entry.last_attempt = Some(LastAttempt {
            sched_rev: rev,
            cause: attempt.spec.cause,
            mode,
            outcome,
            reason: reason.clone(),
            executed,
            drain_ms: status.drain_ms,
        });
        match outcome {
            Outcome::Done => {
                serve(entry, attempt, status, since);
                book.lift(build, mode, node, ctx.halt && was_retry);
                events.push(done_event(node, attempt, status, mode));
            }
            Outcome::Failed | Outcome::Down => {
                book.book(
                    Failure {
                        build,
                        mode,
                        node,
                        reason: &reason,
                        since: &since,
                        was_retry,
                    },
                    ctx.halt,
                );
                let down = outcome == Outcome::Down;
                if down {
                    // Nothing serves: the old generation stopped and the new
                    // one failed. The generation number stays as the newest
                    // that served, so the next attempt is not an install.
                    entry.build = None;
                    entry.sha256 = None;
                    entry.config_rev = None;
                    entry.restart_id = None;
                    entry.since = Some(since);
                }
                events.push(PlanEvent {
                    warning: true,
                    reason: if down { "NodeDown" } else { "SwapFailed" }.into(),
                    message: format!(
                        "node {node}: rev {rev} {}: build {build} ({}){}; held down",
                        if down {
                            "down, nothing serves"
                        } else {
                            "failed, the incumbent still serves"
                        },
                        mode.as_str(),
                        reason_suffix(&reason),
                    ),
                });
            }
            Outcome::Abandoned => {
                // Proven that nothing of the build ran: the allowance is not
                // spent. A retry superseded by a newer retry handed it on.
                let superseded_by_retry = attempts[index + 1..]
                    .iter()
                    .any(|newer| newer.spec.cause == Cause::Retry);
                if was_retry && executed && !superseded_by_retry {
                    book.disarm(build, mode, node, ctx.halt);
                }
                events.push(PlanEvent {
                    warning: false,
                    reason: "SwapAbandoned".into(),
                    message: format!(
                        "node {node}: rev {rev} abandoned ({}, build {build}){}",
                        attempt.spec.cause.as_str(),
                        reason_suffix(&reason),
                    ),
                });
            }
        }
    }
}

fn starts_newer_generation(status: &SwapAttemptStatus, entry: &NodeGeneration) -> bool {
    match (status.generation, entry.generation) {
        (Some(reported), Some(recorded)) => reported > recorded,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// The node now serves what `attempt` carried.
fn serve(
    entry: &mut NodeGeneration,
    attempt: &SwapAttempt,
    status: &SwapAttemptStatus,
    since: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) {
    entry.generation = status.generation.or(entry.generation);
    entry.build = Some(attempt.spec.build.id.clone());
    entry.sha256 = Some(attempt.spec.build.sha256.clone());
    entry.config_rev = Some(attempt.spec.config_rev.clone());
    entry.restart_id = Some(attempt.spec.restart_id.clone());
    entry.since = Some(since);
}

fn done_event(
    node: &str,
    attempt: &SwapAttempt,
    status: &SwapAttemptStatus,
    mode: genswap_crds::Mode,
) -> PlanEvent {
    let generation = status
        .generation
        .map_or_else(String::new, |n| format!(" as generation {n}"));
    PlanEvent {
        warning: false,
        reason: "SwapDone".into(),
        message: format!(
            "node {node}: rev {} done: build {} serves{generation} ({}, {})",
            attempt.spec.sched_rev,
            attempt.spec.build.id,
            mode.as_str(),
            attempt.spec.cause.as_str(),
        ),
    }
}

fn reason_suffix(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(": {reason}")
    }
}
