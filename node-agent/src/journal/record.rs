//! What the journal records of an instance: its generations, the attempt
//! in flight and how far it got, the outcomes not yet acknowledged, and
//! what the supervisor keeps between attempts. [`super::Journal`] writes
//! and reads them as one file per instance.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use genswap_crds::{
    Cause, InstanceKind, Mode, Outcome, ServingState, StepTiming, StopSpec, SwapAttemptSpec,
};
use serde::{Deserialize, Serialize};

use crate::gate::InstanceKey;

/// The file format this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The first generation number of an instance.
pub const FIRST_GENERATION: u64 = 1;
/// Milliseconds since the Unix epoch, the journal's timestamps.
pub fn unix_millis_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// One generation of an instance as the journal knows it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GenerationRecord {
    /// N, strictly increasing per instance.
    pub n: u64,
    /// The build id.
    pub build: String,
    /// The artifact's sha256.
    pub sha256: String,
    /// The store path it was (or will be) executed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_path: Option<PathBuf>,
    /// Its cgroup directory.
    pub cgroup: PathBuf,
    /// Its own socket, `gen-<N>.sock`.
    pub socket: PathBuf,
    /// The configRev it was started with (reported in node status).
    #[serde(default)]
    pub config_rev: String,
    /// The restartID it was started with (reported in node status).
    #[serde(default, rename = "restartID")]
    pub restart_id: String,
    /// When it began serving, unix millis; `None` before it serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_since_ms: Option<i64>,
    /// How it is stopped (signal, timeout), from the attempt that started
    /// it; `None` in journals written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopSpec>,
}

/// How a serving generation ended between attempts (SPEC 5.10).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ExitRecord {
    /// Its generation N.
    pub generation: u64,
    /// Its build id.
    pub build: String,
    /// The main process's exit code, when it exited by itself and this
    /// agent was its parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that killed it, when one did and this agent was its
    /// parent. Neither is known for a generation adopted after a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// The kernel's OOM killer killed a process of its cgroup
    /// (`memory.events` `oom_kill`; false where there is no memory
    /// controller).
    #[serde(default)]
    pub oom_killed: bool,
    /// When the exit was noticed, unix millis.
    pub at_ms: i64,
    /// When the generation began serving, unix millis, when known: how
    /// long it stayed up decides whether the restart backoff resets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_since_ms: Option<i64>,
    /// Why the agent stopped it, when a liveness probe failed: the probe,
    /// the failures in a row and the last observation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness_failed: Option<String>,
}

impl ExitRecord {
    /// An exit 0 this agent saw.
    pub fn clean(&self) -> bool {
        genswap_crds::exited_clean(self.exit_code, self.signal)
    }
}

/// What the supervisor keeps of an instance between attempts (SPEC 5.10):
/// the attempt whose `done` installed what serves (its `serving` block is
/// where the state is reported), that attempt's spec (what a restart starts
/// again), and the restarts since.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Supervised {
    pub attempt: AttemptRef,
    pub spec: SwapAttemptSpec,
    /// The lineage's newest generation: the one serving, or the one that
    /// exited.
    pub generation: u64,
    /// Restarts that reached `done` since the attempt.
    #[serde(default)]
    pub restarts: u32,
    /// Exits in a row with less than the reset time healthy between them:
    /// the restart backoff's exponent.
    #[serde(default)]
    pub consecutive_exits: u32,
    pub state: ServingState,
    /// BackOff: when the next restart is due, unix millis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_at_ms: Option<i64>,
    /// Why it is not running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Supervised {
    /// A lineage that just started serving with `attempt`.
    pub fn new(attempt: AttemptRef, spec: SwapAttemptSpec, generation: u64) -> Self {
        Self {
            attempt,
            spec,
            generation,
            restarts: 0,
            consecutive_exits: 0,
            state: ServingState::Running,
            restart_at_ms: None,
            message: None,
        }
    }
}

/// What an attempt's end does to the instance's [`Supervised`] lineage.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Lineage {
    /// Unchanged (an attempt that left the incumbent as it was).
    #[default]
    Keep,
    /// Replaced: a `done` installed a new lineage.
    Set(Box<Supervised>),
    /// The lineage's `restarts`-th restart serves as `generation`.
    Restarted { restarts: u32, generation: u64 },
    /// Nothing is supervised any more (nothing serves by intent).
    End,
}

/// Which attempt a record is about.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AttemptRef {
    /// The SwapAttempt's name (or the standalone adapter's name for it).
    pub name: String,
    /// The SwapAttempt's uid, when it came from the API server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Its scheduler revision.
    pub sched_rev: i64,
}

/// The instance's parent cgroup limits as they were before an overlap raised
/// them: what to write back on restore. `None` for a file that did not exist
/// (its controller is not enabled), which needs no restore.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SavedLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_max: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids_max: Option<String>,
}

/// The last step an attempt reached. The engine records each phase BEFORE
/// the action it names can have an effect on the host, so recovery always
/// assumes the action may have happened.
///
/// Overlap: `Admitted`, `ParentRaised`, `Spawning`, `Spawned`, `Healthy`,
/// `Switched`, `IncumbentStopped`, `Finished`. Hold and workers: `Admitted`,
/// `IncumbentStopped` (written before the stop begins), `Spawning`,
/// `Spawned`, `Healthy`, `Finished`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "name", rename_all = "camelCase")]
pub enum Phase {
    /// Admitted by the gate; nothing of the attempt has touched the host.
    Admitted,
    /// The parent raise begins; `saved` is what to restore.
    ParentRaised { saved: SavedLimits },
    /// The exec is about to happen: from here a process of the build may
    /// have run, so `executed` can no longer be proven false.
    Spawning,
    /// The successor runs with this pid (in its own cgroup).
    Spawned { pid: i32 },
    /// The successor answered its health check.
    Healthy,
    /// `current.sock` moves (or moved) to the successor.
    Switched,
    /// The incumbent's stop begins (overlap: the retirement after the
    /// switch; hold: the stop before the successor starts).
    IncumbentStopped,
    /// The attempt ended; the record carries its outcome.
    Finished,
}

impl Phase {
    /// The phase's name as the journal file spells it.
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Admitted => "admitted",
            Phase::ParentRaised { .. } => "parentRaised",
            Phase::Spawning => "spawning",
            Phase::Spawned { .. } => "spawned",
            Phase::Healthy => "healthy",
            Phase::Switched => "switched",
            Phase::IncumbentStopped => "incumbentStopped",
            Phase::Finished => "finished",
        }
    }
}

/// How an attempt ended, kept until acknowledged. The fields are what the
/// SwapAttempt's status carries.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OutcomeRecord {
    pub outcome: Outcome,
    pub effective_mode: Mode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    #[serde(default)]
    pub reason: String,
    pub executed: bool,
    #[serde(default)]
    pub clean_exit: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listener_handover: Option<genswap_crds::ListenerHandover>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<StepTiming>,
    pub started_at_ms: i64,
    pub finished_at_ms: i64,
}

/// One attempt of one instance: its intent, how far it got, and its outcome
/// once known.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    pub instance: InstanceKey,
    pub attempt: AttemptRef,
    /// `Some(k)`: not an API attempt but the supervisor's k-th restart of
    /// the lineage `attempt` installed. Never reported as that attempt's
    /// outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<u32>,
    /// The attempt's spec: what the supervisor restarts once it is `done`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<Box<SwapAttemptSpec>>,
    pub cause: Cause,
    #[serde(default)]
    pub kind: InstanceKind,
    /// The mode the attempt asked for.
    pub requested_mode: Mode,
    /// The mode that runs (SPEC §5.2), written with the first record.
    pub effective_mode: Mode,
    /// The generation serving when the attempt was admitted, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incumbent: Option<GenerationRecord>,
    /// The generation the attempt starts; `None` before its number is
    /// reserved (an attempt refused at staging has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub successor: Option<GenerationRecord>,
    /// The last phase reached.
    pub phase: Phase,
    /// Set from [`Phase::ParentRaised`] until [`Record::parent_restored`]:
    /// the parent limits to restore, whatever phase follows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raised_parent: Option<SavedLimits>,
    /// Set from [`Phase::Spawning`] on: a process of the build may have run.
    #[serde(default)]
    pub exec_may_have_run: bool,
    /// The successor's pid once [`Phase::Spawned`] was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub successor_pid: Option<i32>,
    /// How the attempt stops a generation (signal, timeout): crash recovery
    /// stops what the attempt left behind the same way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopSpec>,
    pub started_at_ms: i64,
    pub updated_at_ms: i64,
    /// Set with [`Phase::Finished`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<OutcomeRecord>,
}

impl Record {
    /// A freshly admitted attempt, with its requested and effective modes.
    /// The caller fills in `incumbent` and `successor`.
    pub fn admitted(
        instance: InstanceKey,
        attempt: AttemptRef,
        cause: Cause,
        kind: InstanceKind,
        requested_mode: Mode,
        effective_mode: Mode,
    ) -> Self {
        let now = unix_millis_now();
        Self {
            instance,
            attempt,
            restart: None,
            spec: None,
            cause,
            kind,
            requested_mode,
            effective_mode,
            incumbent: None,
            successor: None,
            phase: Phase::Admitted,
            raised_parent: None,
            exec_may_have_run: false,
            successor_pid: None,
            stop: None,
            started_at_ms: now,
            updated_at_ms: now,
            outcome: None,
        }
    }

    /// Moves to `phase`, keeping what recovery needs after later phases:
    /// the saved parent limits, that the exec may have run, the pid.
    pub fn advance(&mut self, phase: Phase) {
        match &phase {
            Phase::ParentRaised { saved } => self.raised_parent = Some(saved.clone()),
            Phase::Spawning => self.exec_may_have_run = true,
            Phase::Spawned { pid } => {
                self.exec_may_have_run = true;
                self.successor_pid = Some(*pid);
            }
            _ => {}
        }
        self.phase = phase;
        self.updated_at_ms = unix_millis_now();
    }

    /// The raised parent limits were written back.
    pub fn parent_restored(&mut self) {
        self.raised_parent = None;
        self.updated_at_ms = unix_millis_now();
    }

    /// Ends the attempt with `outcome` ([`Phase::Finished`]).
    pub fn finish(&mut self, outcome: OutcomeRecord) {
        self.advance(Phase::Finished);
        self.outcome = Some(outcome);
    }

    /// What this record's end does to the supervised lineage (SPEC 5.10),
    /// given the generation that serves after it: a `done` that left one
    /// serving starts a new lineage (a restart continues its own); a `done`
    /// or `down` after which nothing serves ends it; anything else leaves
    /// it to the supervisor.
    pub fn lineage_after(&self, serving_after: Option<u64>) -> Lineage {
        let outcome = self.outcome.as_ref().map(|o| o.outcome);
        let done = outcome == Some(Outcome::Done);
        match (self.restart, serving_after) {
            (Some(restarts), Some(generation)) if done => Lineage::Restarted {
                restarts,
                generation,
            },
            (Some(_), _) => Lineage::Keep,
            (None, Some(generation)) if done => match &self.spec {
                Some(spec) => Lineage::Set(Box::new(Supervised::new(
                    self.attempt.clone(),
                    (**spec).clone(),
                    generation,
                ))),
                None => Lineage::End,
            },
            (None, None) if done || outcome == Some(Outcome::Down) => Lineage::End,
            (None, _) => Lineage::Keep,
        }
    }

    /// Whether this record and `other` are the same attempt.
    pub fn same_attempt(&self, other: &Record) -> bool {
        self.attempt.sched_rev == other.attempt.sched_rev
            && self.attempt.name == other.attempt.name
            && self.restart == other.restart
    }
}

/// Everything the journal holds for one instance: the content of its file.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InstanceEntry {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    pub instance: InstanceKey,
    /// The next generation number to hand out.
    pub next_generation: u64,
    /// The generation serving now, as far as the journal knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving: Option<GenerationRecord>,
    /// The attempt in flight, or the newest finished one until acknowledged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<Record>,
    /// Finished attempts replaced by a newer one before they were
    /// acknowledged, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unreported: Vec<Record>,
    /// How the last serving generation that exited between attempts ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<ExitRecord>,
    /// What the supervisor keeps between attempts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supervised: Option<Supervised>,
    /// The builds (digests: the main build's, its sidecars') of the lineage
    /// the current one replaced: the store keeps them for a rollback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub previous_builds: Vec<String>,
}

impl InstanceEntry {
    /// Every build digest this instance runs, may run again, or is
    /// starting: what the store must keep for it.
    pub fn builds_in_use(&self) -> Vec<String> {
        let mut digests = Vec::new();
        let mut generation = |g: &Option<GenerationRecord>| {
            if let Some(g) = g {
                digests.push(g.sha256.clone());
            }
        };
        generation(&self.serving);
        // An attempt in flight (or one a crash interrupted) may still run
        // its incumbent or its successor; a finished one runs what serves.
        let in_flight = self.attempt.as_ref().filter(|r| r.outcome.is_none());
        if let Some(record) = in_flight {
            generation(&record.incumbent);
            generation(&record.successor);
            if let Some(spec) = &record.spec {
                digests.extend(builds_of(spec));
            }
        }
        if let Some(supervised) = &self.supervised {
            digests.extend(builds_of(&supervised.spec));
        }
        digests.extend(self.previous_builds.iter().cloned());
        digests.retain(|d| !d.is_empty());
        digests
    }
}

/// The digests of an attempt's build and its sidecars' own builds.
pub fn builds_of(spec: &SwapAttemptSpec) -> Vec<String> {
    std::iter::once(spec.build.sha256.clone())
        .chain(
            spec.sidecars
                .iter()
                .filter_map(|s| s.build.as_ref().map(|b| b.sha256.clone())),
        )
        .collect()
}

impl InstanceEntry {
    pub(super) fn new(instance: InstanceKey) -> Self {
        Self {
            version: FORMAT_VERSION,
            instance,
            next_generation: FIRST_GENERATION,
            serving: None,
            attempt: None,
            unreported: Vec::new(),
            last_exit: None,
            supervised: None,
            previous_builds: Vec::new(),
        }
    }

    /// Finished records of API attempts not yet acknowledged, oldest
    /// first (a restart's record is the supervisor's own).
    pub fn pending_reports(&self) -> Vec<Record> {
        let mut pending = self.unreported.clone();
        pending.extend(
            self.attempt
                .iter()
                .filter(|r| r.outcome.is_some() && r.restart.is_none())
                .cloned(),
        );
        pending
    }

    /// Keeps the counter above every generation the entry mentions.
    pub(super) fn bump_above_known(&mut self) {
        let known = [
            self.serving.as_ref(),
            self.attempt.as_ref().and_then(|r| r.incumbent.as_ref()),
            self.attempt.as_ref().and_then(|r| r.successor.as_ref()),
        ];
        for generation in known.into_iter().flatten() {
            self.next_generation = self.next_generation.max(generation.n.saturating_add(1));
        }
    }
}

/// A journal file that could not be read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorruptEntry {
    pub path: PathBuf,
    /// The instance its name says, when the name is one.
    pub instance: Option<InstanceKey>,
    /// What is wrong with it.
    pub error: String,
}
