//! An engine result as a SwapAttempt's status: the fields and conditions the
//! agent reports, in a cluster and in standalone mode alike.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use genswap_crds::{
    ConditionType, HeldListener, LastExit, ListenerSpec, Mode, Outcome, ServingStatus, StepTiming,
    SwapAttemptStatus, set_condition,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use crate::engine::SwapResult;
use crate::journal::{ExitRecord, OutcomeRecord, Supervised};

/// Condition reasons on a SwapAttempt's status.
pub mod reasons {
    /// The attempt is running.
    pub const RUNNING: &str = "Running";
    /// `done`: the successor serves.
    pub const DONE: &str = "Done";
    /// `failed`: the build failed; the incumbent still serves.
    pub const FAILED: &str = "Failed";
    /// `abandoned`: superseded, refused or cancelled; not the build's fault.
    pub const ABANDONED: &str = "Abandoned";
    /// `down`: a hold's new build failed after the old one stopped.
    pub const DOWN: &str = "Down";
}

/// The status of an attempt that has just been handed to the engine:
/// `Reconciling=True`, no outcome yet.
pub fn status_running(started_at: SystemTime) -> SwapAttemptStatus {
    let now = time_of(started_at);
    let mut status = SwapAttemptStatus {
        started_at: Some(now.clone()),
        ..SwapAttemptStatus::default()
    };
    set_condition(
        &mut status.conditions,
        ConditionType::Ready,
        false,
        reasons::RUNNING,
        "the attempt is running",
        None,
        &now,
    );
    set_condition(
        &mut status.conditions,
        ConditionType::Reconciling,
        true,
        reasons::RUNNING,
        "the attempt is running",
        None,
        &now,
    );
    set_condition(
        &mut status.conditions,
        ConditionType::Stalled,
        false,
        reasons::RUNNING,
        "the attempt is running",
        None,
        &now,
    );
    status
}

/// The SwapAttempt status for an engine result: outcome, effective mode,
/// generation, reason, executed, clean exit, drain, step timings,
/// timestamps, and the conditions (`Ready` on done, `Stalled` on failed or
/// down, `Reconciling` False once it ended).
pub fn status_from_result(result: &SwapResult) -> SwapAttemptStatus {
    finished_status(Finished {
        outcome: result.outcome,
        effective_mode: result.effective_mode,
        generation: result.generation,
        reason: &result.reason,
        executed: result.executed,
        clean_exit: result.clean_exit,
        drain_ms: result.drain_ms(),
        listener_handover: result.listener_handover,
        steps: result.step_timings(),
        started_at: time_of(result.started_at),
        finished_at: time_of(result.finished_at),
    })
}

/// The same status from an outcome kept in the intent journal (an attempt
/// that finished before a restart, not yet acknowledged).
pub fn status_from_outcome_record(record: &OutcomeRecord) -> SwapAttemptStatus {
    finished_status(Finished {
        outcome: record.outcome,
        effective_mode: record.effective_mode,
        generation: record.generation,
        reason: &record.reason,
        executed: record.executed,
        clean_exit: record.clean_exit,
        drain_ms: record.drain_ms,
        listener_handover: record.listener_handover,
        steps: record.steps.clone(),
        started_at: time_of_millis(record.started_at_ms),
        finished_at: time_of_millis(record.finished_at_ms),
    })
}

struct Finished<'a> {
    outcome: Outcome,
    effective_mode: Mode,
    generation: Option<u64>,
    reason: &'a str,
    executed: bool,
    clean_exit: bool,
    drain_ms: Option<i64>,
    listener_handover: Option<genswap_crds::ListenerHandover>,
    steps: Vec<StepTiming>,
    started_at: Time,
    finished_at: Time,
}

fn finished_status(finished: Finished<'_>) -> SwapAttemptStatus {
    let (reason, ready, stalled) = match finished.outcome {
        Outcome::Done => (reasons::DONE, true, false),
        Outcome::Failed => (reasons::FAILED, false, true),
        Outcome::Abandoned => (reasons::ABANDONED, false, false),
        Outcome::Down => (reasons::DOWN, false, true),
    };
    let message = if finished.reason.is_empty() {
        match finished.outcome {
            Outcome::Done => "the successor serves".to_string(),
            other => format!("{other:?}").to_lowercase(),
        }
    } else {
        finished.reason.to_string()
    };
    let now = &finished.finished_at;
    let mut conditions = Vec::new();
    set_condition(
        &mut conditions,
        ConditionType::Ready,
        ready,
        reason,
        &message,
        None,
        now,
    );
    set_condition(
        &mut conditions,
        ConditionType::Reconciling,
        false,
        reason,
        "the attempt has ended",
        None,
        now,
    );
    set_condition(
        &mut conditions,
        ConditionType::Stalled,
        stalled,
        reason,
        &message,
        None,
        now,
    );
    SwapAttemptStatus {
        outcome: Some(finished.outcome),
        effective_mode: Some(finished.effective_mode),
        generation: finished
            .generation
            .map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        reason: (!finished.reason.is_empty()).then(|| finished.reason.to_string()),
        executed: Some(finished.executed),
        clean_exit: finished.clean_exit.then_some(true),
        drain_ms: finished.drain_ms,
        listener_handover: finished.listener_handover,
        started_at: Some(finished.started_at),
        finished_at: Some(finished.finished_at.clone()),
        steps: finished.steps,
        conditions,
        stage: None,
        serving: None,
    }
}

/// The `serving` block a `done` attempt carries for its lineage
/// (SPEC 5.10), from what the supervisor journaled.
pub fn serving_status(
    supervised: &Supervised,
    last_exit: Option<&ExitRecord>,
    sidecars: &[genswap_crds::SidecarStatus],
) -> ServingStatus {
    ServingStatus {
        state: supervised.state,
        generation: i64::try_from(supervised.generation).unwrap_or(i64::MAX),
        restarts: i32::try_from(supervised.restarts).unwrap_or(i32::MAX),
        last_exit: last_exit.map(last_exit_of),
        restart_at: supervised.restart_at_ms.map(time_of_millis),
        message: supervised.message.clone(),
        listeners: held_listeners(&supervised.spec.listeners),
        sidecars: sidecars.to_vec(),
    }
}

/// The listeners a done attempt named: the agent holds exactly those for
/// its lineage ([`crate::listeners::Listeners::keep_only`]).
fn held_listeners(specs: &[ListenerSpec]) -> Vec<HeldListener> {
    specs
        .iter()
        .map(|l| HeldListener {
            name: l.name.clone(),
            address: l.address().to_string(),
        })
        .collect()
}

/// The API's shape of a journaled exit.
pub fn last_exit_of(exit: &ExitRecord) -> LastExit {
    LastExit {
        generation: i64::try_from(exit.generation).unwrap_or(i64::MAX),
        exit_code: exit.exit_code,
        signal: exit.signal,
        oom_killed: exit.oom_killed,
        at: time_of_millis(exit.at_ms),
        liveness_failed: exit.liveness_failed.clone(),
    }
}

/// A wall-clock instant as a Kubernetes time, in whole seconds as the API
/// server stores it (so what is written reads back equal); the epoch for
/// one the timestamp type cannot hold.
pub fn time_of(at: SystemTime) -> Time {
    let exact = Timestamp::try_from(at).unwrap_or(Timestamp::UNIX_EPOCH);
    Time(Timestamp::from_second(exact.as_second()).unwrap_or(Timestamp::UNIX_EPOCH))
}

fn time_of_millis(millis: i64) -> Time {
    let millis = u64::try_from(millis).unwrap_or(0);
    time_of(UNIX_EPOCH + Duration::from_millis(millis))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::StepOutcome;
    use crate::engine::{Step, StepRecord};
    use genswap_crds::conditions::is_true;

    fn result(outcome: Outcome, reason: &str) -> SwapResult {
        let started = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        SwapResult {
            outcome,
            effective_mode: Mode::Overlap,
            generation: Some(3),
            reason: reason.into(),
            executed: outcome != Outcome::Abandoned,
            clean_exit: false,
            drain: Some(Duration::from_millis(42)),
            listener_handover: None,
            steps: vec![StepRecord {
                step: Step::Stage,
                result: StepOutcome::Ok,
                duration: Duration::from_millis(7),
            }],
            started_at: started,
            finished_at: started + Duration::from_secs(2),
        }
    }

    #[test]
    fn done_is_ready_with_every_field() {
        let status = status_from_result(&result(Outcome::Done, ""));
        assert_eq!(status.outcome, Some(Outcome::Done));
        assert_eq!(status.effective_mode, Some(Mode::Overlap));
        assert_eq!(status.generation, Some(3));
        assert_eq!(status.reason, None);
        assert_eq!(status.executed, Some(true));
        assert_eq!(status.drain_ms, Some(42));
        assert_eq!(status.steps.len(), 1);
        assert_eq!(status.steps[0].step, "stage");
        assert!(is_true(&status.conditions, ConditionType::Ready));
        assert!(!is_true(&status.conditions, ConditionType::Reconciling));
        assert!(!is_true(&status.conditions, ConditionType::Stalled));
        assert!(status.finished_at > status.started_at);
    }

    #[test]
    fn failed_and_down_are_stalled_with_the_reason() {
        for outcome in [Outcome::Failed, Outcome::Down] {
            let status = status_from_result(&result(outcome, "health: 500 from /"));
            assert!(is_true(&status.conditions, ConditionType::Stalled));
            assert!(!is_true(&status.conditions, ConditionType::Ready));
            let stalled = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Stalled")
                .expect("a Stalled condition");
            assert_eq!(stalled.message, "health: 500 from /");
        }
    }

    #[test]
    fn abandoned_is_neither_ready_nor_stalled() {
        let status = status_from_result(&result(Outcome::Abandoned, "superseded"));
        assert_eq!(status.executed, Some(false));
        assert!(!is_true(&status.conditions, ConditionType::Ready));
        assert!(!is_true(&status.conditions, ConditionType::Stalled));
    }

    #[test]
    fn a_running_attempt_is_reconciling_without_an_outcome() {
        let status = status_running(SystemTime::now());
        assert_eq!(status.outcome, None);
        assert!(is_true(&status.conditions, ConditionType::Reconciling));
    }
}
