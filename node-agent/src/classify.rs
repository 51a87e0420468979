//! The one outcome classifier (SPEC 5.4).
//!
//! Every step of an attempt (stage, admit, raise, journal, spawn, health,
//! settle, switch, retire, stop) that does not succeed ends with a
//! [`StepError`], and [`classify`] is the only place that decides what that
//! error means:
//!
//! | error | step outcome | attempt outcome |
//! |---|---|---|
//! | the attempt's lifetime ended (shutdown, intentional stop) | `cancelled` | `abandoned` |
//! | the gate refused (superseded, not the node's owner, shutting down, swaps off) | `stale` | `abandoned` |
//! | the instance is mid-operation or cannot run this mode | `stale` | `abandoned` |
//! | staging refused (missing, unreadable, not executable, digest mismatch, outside the root, escaping symlink) | `stale` | `abandoned` |
//! | a requested limit whose controller is not enabled, a cgroup that could not be made fresh | `stale` | `abandoned` |
//! | uid 0 refused, the intent journal not written before the exec | `stale` | `abandoned` |
//! | `current.sock` could not move, the stop could not be proven | `stale` | `abandoned` |
//! | spawn or exec error, not what the attempt chose, unhealthy, exited early | `failed` | `failed` (overlap), `down` (after the incumbent was stopped) |
//!
//! Only `failed` is the build's fault. A stale step is a refusal or a fault
//! of the host, never of the build.

use std::fmt;

use thiserror::Error;

use crate::gate::{GatePoint, GateRefusal};

/// How one step of an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepOutcome {
    /// The step did what it was for.
    Ok,
    /// The attempt's lifetime ended: agent shutdown or an intentional stop.
    Cancelled,
    /// A refusal: the gate's, or the host's before anything of the build ran.
    Stale,
    /// The build's own failure.
    Failed,
}

impl StepOutcome {
    /// `ok`, `cancelled`, `stale` or `failed`, as status reports it.
    pub fn as_str(self) -> &'static str {
        match self {
            StepOutcome::Ok => "ok",
            StepOutcome::Cancelled => "cancelled",
            StepOutcome::Stale => "stale",
            StepOutcome::Failed => "failed",
        }
    }

    /// Whether this is the build's fault (only [`StepOutcome::Failed`]).
    pub fn is_build_failure(self) -> bool {
        self == StepOutcome::Failed
    }
}

impl fmt::Display for StepOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the instance's own state refuses an attempt at admission.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AdmissionRefusal {
    /// Another attempt of the same instance is running.
    #[error("the instance is mid-operation: another attempt of it is running on this node")]
    Busy,
}

/// Why a step did not succeed: one variant per source, each carrying that
/// part's own error.
#[derive(Debug, Error)]
pub enum StepError {
    /// The attempt's lifetime ended.
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// The attempt gate refused.
    #[error("the attempt gate refused at {point}: {refusal}")]
    Gate {
        /// Where it was asked.
        point: GatePoint,
        /// Why it refused.
        #[source]
        refusal: GateRefusal,
    },
    /// The instance's own state refused the attempt.
    #[error("admission: {0}")]
    Admission(#[source] AdmissionRefusal),
}

/// THE classifier: what a step's result means (SPEC 5.4). `lifetime_ended`
/// is whether the attempt's own lifetime (its cancel token) has ended: then
/// whatever error the step met is a cancellation, never the build's fault.
pub fn classify<T>(result: &Result<T, StepError>, lifetime_ended: bool) -> StepOutcome {
    let error = match result {
        Ok(_) => return StepOutcome::Ok,
        Err(error) => error,
    };
    if lifetime_ended {
        return StepOutcome::Cancelled;
    }
    match error {
        StepError::Cancelled(_) => StepOutcome::Cancelled,
        StepError::Gate { .. } | StepError::Admission(_) => StepOutcome::Stale,
    }
}
