//! Staging a build ahead of its rollout: what a `stageOnly` attempt asks
//! (`rollout.prestage`, SPEC 5.15), for both modes. The build goes through
//! the same [`Stager::stage`] a swap's first step calls (fetch, verify its
//! digest and signature, unpack into the store), and nothing starts, stops
//! or is superseded: the engine and the revision gate never see it.
//!
//! While bytes arrive the caller is handed `status.stage` at most every
//! [`PROGRESS_EVERY`], from the first tick on and only when it changed, so
//! a build that stages within that costs no write but its outcome. The outcome
//! classifies as a swap's stage step would: the build's fault (a digest or
//! signature that does not match) is `failed`, the source's or host's (a
//! registry that does not answer, a full disk) `abandoned`; `executed` is
//! always false.

use std::time::{Duration, SystemTime};

use genswap_crds::{BuildSpec, ConditionType, Outcome, StageProgress, SwapAttemptStatus};
use genswap_store::{FetchProgress, Stager};

use crate::attempt_status::time_of;
use crate::classify::{StepError, classify};
use crate::metrics::AgentMetrics;

/// How often a stage in progress reports its bytes at most.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(3);

/// Condition reasons of a stage-only attempt.
pub mod reasons {
    /// Staging.
    pub const STAGING: &str = "Staging";
    /// The node's store holds the build.
    pub const STAGED: &str = "Staged";
}

/// Stages `build`, calling `progress` with the status to show while it
/// fetches, and returns the finished status. `metrics`: where the fetched
/// bytes are counted (standalone mode serves none).
pub async fn stage_ahead(
    stager: &Stager,
    build: &BuildSpec,
    metrics: Option<&AgentMetrics>,
    mut progress: impl FnMut(SwapAttemptStatus),
) -> SwapAttemptStatus {
    let started_at = SystemTime::now();
    let fetch = FetchProgress::new();
    let mut counted = 0u64;
    let mut count = |fetch: &FetchProgress| {
        let now = fetch.fetched();
        if let Some(metrics) = metrics {
            metrics.record_stage_bytes(now.saturating_sub(counted));
        }
        counted = now;
    };
    // The first write waits a tick: a build that stages within it costs
    // no write but its outcome.
    let mut shown = None;
    let work = stager.stage_watched(build, &fetch);
    tokio::pin!(work);
    let mut ticks = tokio::time::interval(PROGRESS_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    let result = loop {
        tokio::select! {
            result = &mut work => break result,
            _ = ticks.tick() => {
                count(&fetch);
                let now = stage_of(&fetch);
                if shown != Some(now) {
                    shown = Some(now);
                    progress(staging_status(started_at, now));
                }
            }
        }
    };
    count(&fetch);
    let stage = stage_of(&fetch);
    match result {
        Ok(staged) => {
            tracing::info!(build = %build.id, fetched = staged.fetched, "staged ahead of the rollout");
            let reason = if staged.fetched == 0 {
                "the store holds it: nothing needed fetching".to_string()
            } else {
                format!("staged; fetched {} bytes", staged.fetched)
            };
            finished_status(started_at, Outcome::Done, reason, stage)
        }
        Err(error) => {
            let reason = format!("stage: {error}");
            // Classified as the swap's stage step is, by the one classifier.
            let failed: Result<(), StepError> = Err(StepError::Stage(error));
            let outcome = if classify(&failed, false).is_build_failure() {
                Outcome::Failed
            } else {
                Outcome::Abandoned
            };
            tracing::warn!(build = %build.id, ?outcome, %reason, "staging ahead failed");
            finished_status(started_at, outcome, reason, stage)
        }
    }
}

fn stage_of(fetch: &FetchProgress) -> StageProgress {
    let bytes = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    StageProgress {
        fetched_bytes: bytes(fetch.fetched()),
        total_bytes: fetch.total().map(bytes),
    }
}

/// A stage under way: `startedAt`, its bytes, `Reconciling=True`.
pub fn staging_status(started_at: SystemTime, stage: StageProgress) -> SwapAttemptStatus {
    let now = time_of(started_at);
    let mut status = SwapAttemptStatus {
        started_at: Some(now.clone()),
        stage: Some(stage),
        executed: Some(false),
        ..SwapAttemptStatus::default()
    };
    for (kind, state) in [
        (ConditionType::Ready, false),
        (ConditionType::Reconciling, true),
        (ConditionType::Stalled, false),
    ] {
        genswap_crds::set_condition(
            &mut status.conditions,
            kind,
            state,
            reasons::STAGING,
            "staging the build ahead of its rollout",
            None,
            &now,
        );
    }
    status
}

/// A stage that ended: `Ready` once the store holds the build, `Stalled`
/// when the build itself is at fault.
pub fn finished_status(
    started_at: SystemTime,
    outcome: Outcome,
    reason: String,
    stage: StageProgress,
) -> SwapAttemptStatus {
    let now = time_of(SystemTime::now());
    let condition_reason = match outcome {
        Outcome::Done => reasons::STAGED,
        Outcome::Failed => crate::attempt_status::reasons::FAILED,
        _ => crate::attempt_status::reasons::ABANDONED,
    };
    let mut status = SwapAttemptStatus {
        outcome: Some(outcome),
        reason: Some(reason.clone()),
        executed: Some(false),
        started_at: Some(time_of(started_at)),
        finished_at: Some(now.clone()),
        stage: Some(stage),
        ..SwapAttemptStatus::default()
    };
    for (kind, state) in [
        (ConditionType::Ready, outcome == Outcome::Done),
        (ConditionType::Reconciling, false),
        (ConditionType::Stalled, outcome == Outcome::Failed),
    ] {
        genswap_crds::set_condition(
            &mut status.conditions,
            kind,
            state,
            condition_reason,
            &reason,
            None,
            &now,
        );
    }
    status
}
