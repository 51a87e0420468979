//! `status.rollout` and the progress deadline (SPEC 3.1
//! `rollout.progressDeadlineSeconds`): a rollout that has not moved for
//! that long is `Stalled` with `ProgressDeadlineExceeded`, as a Deployment
//! is.
//!
//! A rollout moves when the desired state changes, an attempt is issued,
//! or the numbers of nodes selected, serving and in flight change (an
//! outcome). Its last move is kept in the status, so a restarted
//! controller or a new leader keeps counting from it. The clock does not
//! run while nothing is due: every node serves, the rollout is paused, or
//! a finished wave bakes.

use std::time::Duration;

use genswap_crds::{InstanceGenerationStatus, RolloutStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::Context;
use super::rollout::Progress;

/// What the deadline decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Deadline {
    /// Seconds since the rollout last moved, once past the deadline.
    pub exceeded_after: Option<i64>,
    /// When to look again to notice it passing.
    pub due_in: Option<Duration>,
    /// When the rollout last moved (ms since the epoch).
    pub last_progress: Option<i64>,
}

/// The rollout's place for the status, and the deadline's verdict.
pub(super) fn observe(
    previous: Option<&InstanceGenerationStatus>,
    ctx: &Context<'_>,
    progress: &Progress<'_>,
    wave_names: &[String],
    issued: bool,
) -> (RolloutStatus, Deadline) {
    let now_ms = ctx.now.0.as_millisecond();
    let before = previous.and_then(|status| status.rollout.as_ref());
    let counts = previous.and_then(|status| status.counts.as_ref());
    let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
    let moved = issued
        || previous.and_then(|status| status.desired.as_ref()) != Some(&ctx.desired)
        || counts.is_none_or(|c| {
            (c.selected, c.ready, c.in_flight)
                != (
                    count(progress.selected),
                    count(progress.ready),
                    count(progress.in_flight),
                )
        });
    let last_ms = match before.and_then(|b| b.last_progress_time.as_ref()) {
        Some(last) if !moved => last.0.as_millisecond(),
        _ => now_ms,
    };
    let position = progress.position;
    let status = RolloutStatus {
        wave: position
            .wave
            .and_then(|wave| wave_names.get(wave))
            .map(|name| name.chars().take(63).collect()),
        wave_index: position.wave.and_then(|wave| i32::try_from(wave).ok()),
        waves: i32::try_from(wave_names.len().saturating_sub(1)).ok(),
        baking_until: position.baking_until.and_then(time_at),
        last_progress_time: time_at(last_ms),
        analysis: None,
        prestage: None,
    };

    // Nodes that run the desired state (down between attempts or not), and
    // those the failure book holds, which wait for a human (Stalled says
    // so with its own reason), are nothing the rollout waits on.
    let settled = progress.ready + progress.down_between.len() + progress.stalled.len();
    let nothing_due = ctx.spec.rollout.paused
        || progress.selected == 0
        || settled >= progress.selected
        || position.baking_until.is_some()
        || position.analysis.is_some()
        // Pre-staging has a deadline of its own.
        || progress.prestage.closed;
    let deadline_ms = ctx
        .spec
        .rollout
        .progress_deadline_seconds
        .max(1)
        .saturating_mul(1000);
    let still = now_ms.saturating_sub(last_ms);
    let deadline = if nothing_due {
        Deadline::default()
    } else if still > deadline_ms {
        Deadline {
            exceeded_after: Some(still / 1000),
            ..Deadline::default()
        }
    } else {
        // A moment past it, so that the plan then sees it passed.
        let left = deadline_ms - still + 1;
        Deadline {
            due_in: Some(Duration::from_millis(u64::try_from(left).unwrap_or(0))),
            ..Deadline::default()
        }
    };
    (
        status,
        Deadline {
            last_progress: Some(last_ms),
            ..deadline
        },
    )
}

fn time_at(ms: i64) -> Option<Time> {
    Timestamp::from_millisecond(ms).ok().map(Time)
}
