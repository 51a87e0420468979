//! The engine's public vocabulary: what goes in (an [`Attempt`]) and what
//! comes out (a [`SwapResult`]).

use std::fmt;
use std::time::{Duration, SystemTime};

use genswap_crds::{
    Demand, InstanceKind, Mode, Outcome, SocketLayout, StepTiming, SwapAttemptSpec,
};

use crate::classify::StepOutcome;
use crate::gate::{AttemptId, InstanceKey};

/// One try at moving one instance on this node to a new generation: the
/// SwapAttempt's spec as the controller issued it, never changed after.
#[derive(Clone, Debug, PartialEq)]
pub struct Attempt {
    /// The instance this attempt moves.
    pub instance: InstanceKey,
    /// The SwapAttempt's name (`<ig>-<node>-<schedRev>`), kept in the journal
    /// so the outcome can be written back to the right object.
    pub name: String,
    /// The spec snapshot: schedRev, cause, kind, build, mode, demand,
    /// configRev, restartID, canary, process, health, settle, stop,
    /// resources and socket.
    pub spec: SwapAttemptSpec,
    /// `Some(k)`: the supervisor's k-th restart of the lineage this API
    /// attempt installed (SPEC 5.10), not the API attempt itself. `None`
    /// for every attempt an adapter hands in.
    pub restart: Option<u32>,
}

impl Attempt {
    /// What the gate is asked about.
    pub fn id(&self) -> AttemptId {
        AttemptId {
            instance: self.instance.clone(),
            sched_rev: self.spec.sched_rev,
        }
    }

    /// The mode this attempt actually runs in (SPEC 5.2): an overlap runs as
    /// a hold when the instance binds a fixed socket, when the artifact
    /// demands hold, or when the instance is a worker (workers always stop
    /// then start).
    pub fn effective_mode(&self) -> Mode {
        effective_mode(&self.spec)
    }

    /// Whether the successor is watched for the settle window after it is
    /// healthy: canaries, every attempt with `settle.allNodes`, and every
    /// worker (a worker's window is how a one-shot's clean exit is told from
    /// a crash, so it always applies).
    pub fn settles(&self) -> bool {
        self.spec.canary || self.spec.settle.all_nodes || self.spec.kind == InstanceKind::Worker
    }
}

/// The mode an attempt with `spec` runs in (SPEC 5.2).
pub fn effective_mode(spec: &SwapAttemptSpec) -> Mode {
    let must_hold = spec.socket.layout == SocketLayout::Fixed
        || spec.demand == Demand::Hold
        || spec.kind == InstanceKind::Worker;
    if must_hold { Mode::Hold } else { spec.mode }
}

/// The named steps of an attempt, in the order an overlap runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Resolve, copy, hash and verify the artifact into the store.
    Stage,
    /// The gate at admission and the instance's own checks.
    Admit,
    /// Raise the instance's parent cgroup limits (overlap).
    Raise,
    /// The intent record before the exec.
    Journal,
    /// The gate right before the exec, then the successor's spawn.
    Spawn,
    /// HTTP health over the successor's own socket.
    Health,
    /// The settle window.
    Settle,
    /// The gate at the switch, then repointing `current.sock`.
    Switch,
    /// Stopping the former incumbent after a switch (overlap).
    Retire,
    /// Stopping the incumbent before the successor starts (hold, worker).
    Stop,
}

impl Step {
    /// The step's name as it appears in status and the journal.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Stage => "stage",
            Step::Admit => "admit",
            Step::Raise => "raise",
            Step::Journal => "journal",
            Step::Spawn => "spawn",
            Step::Health => "health",
            Step::Settle => "settle",
            Step::Switch => "switch",
            Step::Retire => "retire",
            Step::Stop => "stop",
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How one step of an attempt ended and how long it took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRecord {
    /// Which step.
    pub step: Step,
    /// What the one classifier made of it.
    pub result: StepOutcome,
    /// Wall time spent in the step.
    pub duration: Duration,
}

/// How an attempt ended: what the agent writes to the SwapAttempt's status.
#[derive(Clone, Debug, PartialEq)]
pub struct SwapResult {
    /// `done`, `failed`, `abandoned` or `down` (SPEC 5.4).
    pub outcome: Outcome,
    /// The mode that actually ran (SPEC 5.2).
    pub effective_mode: Mode,
    /// The generation N the attempt started, or would have started; `None`
    /// when it ended before a number was reserved.
    pub generation: Option<u64>,
    /// Why, in words a human can act on; empty on a plain `done`.
    pub reason: String,
    /// `false` only when it is proven that no process of the build started;
    /// `true` when one did or when it cannot be known.
    pub executed: bool,
    /// A worker's new build exited 0 inside the settle window: a one-shot's
    /// success.
    pub clean_exit: bool,
    /// From the stop signal to the proven exit of the generation this
    /// attempt stopped (the retiring one in an overlap, the incumbent in a
    /// hold); `None` when nothing was stopped.
    pub drain: Option<Duration>,
    /// How the attempt's TCP listeners reached generations (SPEC 6.3);
    /// `None` without listeners.
    pub listener_handover: Option<genswap_crds::ListenerHandover>,
    /// Every step that ran, in order.
    pub steps: Vec<StepRecord>,
    /// When the engine took the attempt.
    pub started_at: SystemTime,
    /// When the outcome was decided.
    pub finished_at: SystemTime,
}

impl SwapResult {
    /// The step records as the SwapAttempt status carries them.
    pub fn step_timings(&self) -> Vec<StepTiming> {
        self.steps
            .iter()
            .map(|record| StepTiming {
                step: record.step.as_str().to_string(),
                result: record.result.as_str().to_string(),
                millis: i64::try_from(record.duration.as_millis()).unwrap_or(i64::MAX),
            })
            .collect()
    }

    /// The drain time in whole milliseconds, as `status.drainMs` carries it.
    pub fn drain_ms(&self) -> Option<i64> {
        self.drain
            .map(|drain| i64::try_from(drain.as_millis()).unwrap_or(i64::MAX))
    }

    /// The time spent in `step`, summed over its records (zero when it did
    /// not run).
    pub fn step_duration(&self, step: Step) -> Duration {
        self.steps
            .iter()
            .filter(|record| record.step == step)
            .map(|record| record.duration)
            .sum()
    }
}
