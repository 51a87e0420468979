//! The per-instance intent journal (SPEC §5.5 step 4, §5.7).
//!
//! One file per instance, `<state dir>/journal/<namespace>.<instance>.json`,
//! holds everything the agent must know about that instance after a crash:
//!
//! - the generation counter: the next N to hand out, strictly above every N
//!   ever handed out or seen on the host, across restarts;
//! - the serving generation, so a restarted agent adopts it;
//! - the attempt in flight, as a [`Record`] the engine advances step by step
//!   ([`Phase`]), written before the step it announces takes effect on the
//!   host; and, once it ended, its outcome until the adapter acknowledges
//!   that the API server (or the standalone status file) accepted it;
//! - outcomes of earlier attempts not yet acknowledged when a newer attempt
//!   began (`unreported`), so no outcome is ever lost.
//!
//! Every write replaces the whole file: a temp file in the same directory is
//! written and fsynced, renamed over the file, and (for a [`Durability::Durable`]
//! write) the directory is fsynced. A reader sees the old file or the new
//! one, never a mix; a crash leaves at most a `*.tmp-*` file that readers
//! ignore and [`Journal::remove_temp_files`] deletes.
//!
//! # Which writes are durable
//!
//! Every write survives the agent's own death: the rename is visible to the
//! next agent at once. What a crash of the whole node may undo is a rename
//! whose directory was not fsynced. A [`Durability::Ordered`] write skips
//! that fsync: after a node crash the file is that version or an earlier
//! one, each whole (its bytes were synced before the rename). The engine
//! uses it for phases whose loss a node crash makes harmless, because the
//! crash stops every generation and recovery's decision for an earlier
//! phase with nothing running is the same: admitted, a parent raise (the
//! cgroup is gone too), spawned, healthy, the switch's serving record. Two
//! writes stay durable: the intent before the exec (`spawning`: a build may
//! have run, so `executed` can never be read back as false) and the outcome
//! with the lineage (what was reported `done` is what is started again).
//!
//! Each file carries a `checksum`, the sha256 of the entry's compact JSON,
//! so damage that still leaves well-formed JSON (a flipped digit, a letter
//! changed inside a string) is found too; a file without one (written before
//! checksums) is read as it stands. A file that cannot be read back
//! (truncated by a disk fault, garbage, a checksum that does not match,
//! another format version) is reported as a [`CorruptEntry`] by
//! [`Journal::load_all`] and never hides other instances. Writes to that
//! instance are refused until recovery quarantines the file
//! ([`Journal::quarantine`]); the generation counter is then rebuilt with
//! [`Journal::observe_generation`] from what the host shows.
//!
//! Calls are blocking file I/O (each write is one fsync'd file and one
//! fsync'd directory): async callers run them in `spawn_blocking`. Calls for
//! the same instance are serialized inside the journal, so the adapter may
//! acknowledge while the engine records. Open the journal only while holding
//! the node lock: one agent writes it at a time.
//!
//! For the one classifier (SPEC §5.4) a [`JournalError`] before the exec is
//! `stale`: the host refused, nothing of the build ran.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use genswap_crds::{
    Cause, InstanceKind, Mode, Outcome, ServingState, StepTiming, StopSpec, SwapAttemptSpec,
};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::disk_name::temp_name;
use crate::disk_name::{self, DiskName};
use crate::gate::InstanceKey;
use crate::switch::fsync_dir;

/// How far a write must have reached the disk before it returns (see the
/// module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Survives a crash of the node: the file and its directory are fsynced.
    #[default]
    Durable,
    /// Survives the agent's death; a node crash leaves this version or an
    /// earlier one, whole: the file is fsynced, its directory is not.
    Ordered,
}

/// One write of an attempt's record, and what else it changes in the same
/// file.
#[derive(Clone, Debug, Default)]
pub struct AttemptWrite {
    pub durability: Durability,
    /// What the attempt's end does to the supervised lineage.
    pub lineage: Lineage,
    /// `Some`: the generation serving now (`Some(None)`: nothing serves).
    pub serving: Option<Option<GenerationRecord>>,
}

/// The journal's directory under the agent's state dir.
pub const JOURNAL_DIR: &str = "journal";
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
}

impl InstanceEntry {
    fn new(instance: InstanceKey) -> Self {
        Self {
            version: FORMAT_VERSION,
            instance,
            next_generation: FIRST_GENERATION,
            serving: None,
            attempt: None,
            unreported: Vec::new(),
            last_exit: None,
            supervised: None,
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
    fn bump_above_known(&mut self) {
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

/// Why a journal operation failed.
#[derive(Debug, Error)]
pub enum JournalError {
    #[error("cannot create the journal directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the journal directory {path}: {source}")]
    ReadDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the journal file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the journal file {path} is corrupt ({error}); recovery must quarantine it before this instance can swap"
    )]
    Corrupt { path: PathBuf, error: String },
    #[error("cannot write the journal file {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot encode the journal entry for {instance}: {source}")]
    Encode {
        instance: InstanceKey,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "attempt {in_flight} (schedRev {sched_rev}, phase {phase}) of {instance} is still in flight; it must finish or be recovered before another is journaled"
    )]
    InFlight {
        instance: InstanceKey,
        in_flight: String,
        sched_rev: i64,
        phase: &'static str,
    },
    #[error("the generation counter of {instance} is exhausted")]
    GenerationsExhausted { instance: InstanceKey },
}

/// The intent journal under `<state dir>/journal`.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    /// One lock per instance: read-modify-write of one file is atomic
    /// against other calls for the same instance.
    locks: Mutex<HashMap<InstanceKey, Arc<Mutex<()>>>>,
}

impl Journal {
    /// Opens (creating, mode 0700) `<state_dir>/journal`.
    pub fn open(state_dir: &Path) -> Result<Self, JournalError> {
        let dir = state_dir.join(JOURNAL_DIR);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|source| JournalError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        Ok(Self {
            dir,
            locks: Mutex::new(HashMap::new()),
        })
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `<journal dir>/<disk name>.json`.
    pub fn path_of(&self, instance: &InstanceKey) -> PathBuf {
        self.dir.join(file_name(instance))
    }

    /// [`Journal::path_of`] for the journal of `state_dir`, without opening it.
    pub fn path_in(state_dir: &Path, instance: &InstanceKey) -> PathBuf {
        state_dir.join(JOURNAL_DIR).join(file_name(instance))
    }

    /// Writes `record` as the instance's attempt (durably, before returning).
    ///
    /// The same attempt (same name and schedRev) is replaced. A different
    /// attempt replaces a finished one, whose outcome moves to `unreported`;
    /// it is refused with [`JournalError::InFlight`] while the one on file
    /// has not finished. The generation counter is kept above the record's
    /// generations.
    pub fn record(&self, record: &Record) -> Result<(), JournalError> {
        self.write_attempt(record, AttemptWrite::default())
    }

    /// [`record`](Self::record), and in the same write what the attempt's
    /// end does to the supervised lineage.
    pub fn finish(&self, record: &Record, lineage: Lineage) -> Result<(), JournalError> {
        self.write_attempt(
            record,
            AttemptWrite {
                lineage,
                ..AttemptWrite::default()
            },
        )
    }

    /// [`record`](Self::record) with the durability and the other changes
    /// `write` asks for, all in one write of the file.
    pub fn write_attempt(&self, record: &Record, write: AttemptWrite) -> Result<(), JournalError> {
        let AttemptWrite {
            durability,
            lineage,
            serving,
        } = write;
        self.update_with(&record.instance, durability, |entry| {
            if let Some(current) = entry.attempt.take() {
                if current.same_attempt(record) {
                    // Replaced below.
                } else if current.outcome.is_some() {
                    entry.unreported.push(current);
                } else {
                    let err = JournalError::InFlight {
                        instance: record.instance.clone(),
                        in_flight: current.attempt.name.clone(),
                        sched_rev: current.attempt.sched_rev,
                        phase: current.phase.name(),
                    };
                    entry.attempt = Some(current);
                    return Err(err);
                }
            }
            entry.attempt = Some(record.clone());
            if let Some(serving) = serving {
                entry.serving = serving;
            }
            entry.bump_above_known();
            if record.restart.is_some() && record.outcome.is_some() {
                // Nobody reports a restart: once it ended, the lineage is
                // what is kept of it.
                entry.attempt = None;
            }
            match lineage {
                Lineage::Keep => {}
                Lineage::Set(supervised) => {
                    entry.last_exit = None;
                    entry.supervised = Some(*supervised);
                }
                Lineage::Restarted {
                    restarts,
                    generation,
                } => {
                    if let Some(supervised) = entry.supervised.as_mut() {
                        supervised.restarts = restarts;
                        supervised.generation = generation;
                        supervised.state = ServingState::Running;
                        supervised.restart_at_ms = None;
                        supervised.message = None;
                    }
                }
                Lineage::End => entry.supervised = None,
            }
            Ok(((), true))
        })
    }

    /// Changes the instance's supervised lineage with `change` and returns
    /// the entry as written; `None` when there is no lineage.
    ///
    /// Ordered, not durable: the supervisor's state between an exit and its
    /// restart (state, backoff, message) is worked out again from the host
    /// after a node crash, which stops every generation anyway.
    pub fn update_supervised(
        &self,
        instance: &InstanceKey,
        change: impl FnOnce(&mut Supervised),
    ) -> Result<Option<InstanceEntry>, JournalError> {
        self.update_with(instance, Durability::Ordered, |entry| {
            let Some(supervised) = entry.supervised.as_mut() else {
                return Ok((None, false));
            };
            change(supervised);
            Ok((Some(entry.clone()), true))
        })
    }

    /// Nothing serves by intent (the instance was stopped): no generation
    /// and no lineage to restart.
    /// No file is written for an instance that has none.
    pub fn stopped(&self, instance: &InstanceKey) -> Result<(), JournalError> {
        self.locked(instance, || {
            let Some(mut entry) = self.read_entry(instance)? else {
                return Ok(());
            };
            if entry.serving.is_none() && entry.supervised.is_none() {
                return Ok(());
            }
            entry.serving = None;
            entry.supervised = None;
            self.write_entry(&entry, Durability::Durable)
        })
    }

    /// The instance's current attempt record (in flight, or finished and
    /// unacknowledged); `None` when there is none or no file.
    pub fn load(&self, instance: &InstanceKey) -> Result<Option<Record>, JournalError> {
        let entry = self.locked(instance, || self.read_entry(instance))?;
        Ok(entry.and_then(|entry| entry.attempt))
    }

    /// Everything on file for the instance.
    pub fn load_entry(
        &self,
        instance: &InstanceKey,
    ) -> Result<Option<InstanceEntry>, JournalError> {
        self.locked(instance, || self.read_entry(instance))
    }

    /// Every instance's entry, sorted by instance, and every file that could
    /// not be read back. One bad file never hides the others; only a
    /// journal directory that cannot be listed is an error. Temp files of
    /// interrupted writes and quarantined files are skipped.
    pub fn load_all(&self) -> Result<(Vec<InstanceEntry>, Vec<CorruptEntry>), JournalError> {
        let read_dir_err = |source| JournalError::ReadDir {
            path: self.dir.clone(),
            source,
        };
        let mut entries = Vec::new();
        let mut corrupt = Vec::new();
        for dir_entry in fs::read_dir(&self.dir).map_err(read_dir_err)? {
            let dir_entry = dir_entry.map_err(read_dir_err)?;
            let file_name = dir_entry.file_name();
            let path = dir_entry.path();
            let Some(name) = file_name.to_str() else {
                corrupt.push(CorruptEntry {
                    path,
                    instance: None,
                    error: "the file name is not UTF-8".into(),
                });
                continue;
            };
            if is_temp_name(name) || is_quarantined_name(name) {
                continue;
            }
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            // A cut name does not say its key; the file does.
            let Some(instance) = disk_name::resolve_name(stem, || named_in(&path)) else {
                corrupt.push(CorruptEntry {
                    path,
                    instance: None,
                    error: "the file name is not the disk name of an instance (whole, or cut for the instance the file names)".into(),
                });
                continue;
            };
            match self.locked(&instance, || self.read_entry(&instance)) {
                Ok(Some(entry)) => entries.push(entry),
                Ok(None) => {}
                Err(e) => corrupt.push(CorruptEntry {
                    path,
                    instance: Some(instance),
                    error: match e {
                        JournalError::Corrupt { error, .. } => error,
                        other => other.to_string(),
                    },
                }),
            }
        }
        entries.sort_by(|a, b| a.instance.cmp(&b.instance));
        corrupt.sort_by(|a, b| a.path.cmp(&b.path));
        Ok((entries, corrupt))
    }

    /// Drops the outcome of the instance's attempt with `sched_rev` once the
    /// API server accepted it. A no-op (`Ok(false)`) when no finished record
    /// of that revision is on file: a newer attempt replaced it and it was
    /// acknowledged before, or it has not finished.
    pub fn acknowledge(
        &self,
        instance: &InstanceKey,
        sched_rev: i64,
    ) -> Result<bool, JournalError> {
        self.update(instance, |entry| {
            let before = entry.unreported.len();
            entry
                .unreported
                .retain(|r| r.attempt.sched_rev != sched_rev);
            let mut changed = entry.unreported.len() != before;
            if entry
                .attempt
                .as_ref()
                .is_some_and(|r| r.attempt.sched_rev == sched_rev && r.outcome.is_some())
            {
                entry.attempt = None;
                changed = true;
            }
            Ok((changed, changed))
        })
    }

    /// Every finished, unacknowledged record of every readable instance,
    /// oldest first per instance. Corrupt files are skipped here;
    /// [`Journal::load_all`] reports them.
    pub fn pending_reports(&self) -> Result<Vec<Record>, JournalError> {
        let (entries, _corrupt) = self.load_all()?;
        Ok(entries
            .iter()
            .flat_map(InstanceEntry::pending_reports)
            .collect())
    }

    /// The number the instance's next generation takes, without a write:
    /// the first record that names it as a successor moves the counter past
    /// it (every write keeps the counter above the generations it names).
    /// Nothing may use the number on the host before such a record is on
    /// file; until then, handing it out again is harmless.
    pub fn next_generation(&self, instance: &InstanceKey) -> Result<u64, JournalError> {
        let entry = self.locked(instance, || self.read_entry(instance))?;
        let mut entry = entry.unwrap_or_else(|| InstanceEntry::new(instance.clone()));
        entry.bump_above_known();
        if entry.next_generation == u64::MAX {
            return Err(JournalError::GenerationsExhausted {
                instance: instance.clone(),
            });
        }
        Ok(entry.next_generation)
    }

    /// Keeps the instance's counter above `generation`, a number seen on the
    /// host (a `gen-<N>` cgroup or socket). Recovery calls it for each one.
    pub fn observe_generation(
        &self,
        instance: &InstanceKey,
        generation: u64,
    ) -> Result<(), JournalError> {
        self.update(instance, |entry| {
            let above = generation.saturating_add(1);
            let changed = above > entry.next_generation;
            entry.next_generation = entry.next_generation.max(above);
            Ok(((), changed))
        })
    }

    /// Records the generation serving now (`None`: nothing serves).
    pub fn set_serving(
        &self,
        instance: &InstanceKey,
        serving: Option<GenerationRecord>,
    ) -> Result<(), JournalError> {
        self.update(instance, |entry| {
            entry.serving = serving;
            entry.bump_above_known();
            Ok(((), true))
        })
    }

    /// Records that the serving generation `exit.generation` exited between
    /// attempts: nothing serves, and how it ended. Does nothing when another
    /// generation is recorded as serving.
    ///
    /// Ordered, not durable: undone by a node crash, the entry still names
    /// a generation that is not running after it, which recovery treats as
    /// an exit it did not see.
    pub fn record_exit(
        &self,
        instance: &InstanceKey,
        exit: ExitRecord,
    ) -> Result<(), JournalError> {
        self.update_with(instance, Durability::Ordered, |entry| {
            if entry
                .serving
                .as_ref()
                .is_some_and(|serving| serving.n != exit.generation)
            {
                return Ok(((), false));
            }
            entry.serving = None;
            entry.last_exit = Some(exit);
            Ok(((), true))
        })
    }

    /// The generation serving, as recorded.
    pub fn serving(
        &self,
        instance: &InstanceKey,
    ) -> Result<Option<GenerationRecord>, JournalError> {
        Ok(self.load_entry(instance)?.and_then(|entry| entry.serving))
    }

    /// Deletes the instance's file: its InstanceGeneration is gone and
    /// nothing of it runs. Refused while an attempt is in flight; pending
    /// outcomes are lost, so acknowledge them first.
    pub fn remove_instance(&self, instance: &InstanceKey) -> Result<(), JournalError> {
        self.locked(instance, || self.remove_instance_locked(instance))
    }

    fn remove_instance_locked(&self, instance: &InstanceKey) -> Result<(), JournalError> {
        if let Some(entry) = self.read_entry(instance)?
            && let Some(current) = entry.attempt.filter(|r| r.outcome.is_none())
        {
            return Err(JournalError::InFlight {
                instance: instance.clone(),
                in_flight: current.attempt.name,
                sched_rev: current.attempt.sched_rev,
                phase: current.phase.name(),
            });
        }
        let path = self.path_of(instance);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(source) => return Err(JournalError::Write { path, source }),
        }
        fsync_dir(&self.dir).map_err(|source| JournalError::Write {
            path: self.dir.clone(),
            source,
        })
    }

    /// Renames a corrupt file to `<name>.corrupt-<unix millis>` (kept for a
    /// human to read) so the instance can be journaled again from scratch.
    /// Returns the new path.
    pub fn quarantine(&self, corrupt: &CorruptEntry) -> Result<PathBuf, JournalError> {
        let name = corrupt
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = self
            .dir
            .join(format!("{name}.corrupt-{}", unix_millis_now()));
        fs::rename(&corrupt.path, &target).map_err(|source| JournalError::Write {
            path: corrupt.path.clone(),
            source,
        })?;
        fsync_dir(&self.dir).map_err(|source| JournalError::Write {
            path: self.dir.clone(),
            source,
        })?;
        Ok(target)
    }

    /// Deletes temp files left by writes a crash interrupted; returns how
    /// many. Call only while holding the node lock.
    pub fn remove_temp_files(&self) -> Result<usize, JournalError> {
        let read_dir_err = |source| JournalError::ReadDir {
            path: self.dir.clone(),
            source,
        };
        let mut removed = 0;
        for dir_entry in fs::read_dir(&self.dir).map_err(read_dir_err)? {
            let dir_entry = dir_entry.map_err(read_dir_err)?;
            if dir_entry.file_name().to_str().is_some_and(is_temp_name) {
                let path = dir_entry.path();
                fs::remove_file(&path).map_err(|source| JournalError::Write { path, source })?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Read, change, and (when `change` says so) write back one instance's
    /// entry under its lock. `change` returns its result and whether the
    /// entry changed.
    fn update<T>(
        &self,
        instance: &InstanceKey,
        change: impl FnOnce(&mut InstanceEntry) -> Result<(T, bool), JournalError>,
    ) -> Result<T, JournalError> {
        self.update_with(instance, Durability::Durable, change)
    }

    fn update_with<T>(
        &self,
        instance: &InstanceKey,
        durability: Durability,
        change: impl FnOnce(&mut InstanceEntry) -> Result<(T, bool), JournalError>,
    ) -> Result<T, JournalError> {
        self.locked(instance, || {
            let mut entry = self
                .read_entry(instance)?
                .unwrap_or_else(|| InstanceEntry::new(instance.clone()));
            let (result, changed) = change(&mut entry)?;
            if changed {
                self.write_entry(&entry, durability)?;
            }
            Ok(result)
        })
    }

    fn read_entry(&self, instance: &InstanceKey) -> Result<Option<InstanceEntry>, JournalError> {
        let path = self.path_of(instance);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(JournalError::Read { path, source }),
        };
        let corrupt = |error: String| JournalError::Corrupt {
            path: path.clone(),
            error,
        };
        let entry: InstanceEntry = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(format!("not a journal entry: {e}")))?;
        if entry.version != FORMAT_VERSION {
            return Err(corrupt(format!(
                "format version {} is not the supported {FORMAT_VERSION}",
                entry.version
            )));
        }
        let records = entry.attempt.iter().chain(entry.unreported.iter());
        if entry.instance != *instance || records.clone().any(|r| r.instance != *instance) {
            return Err(corrupt(format!(
                "it names instance {} but the file is {instance}'s",
                entry.instance
            )));
        }
        verify_checksum(&bytes, &entry).map_err(corrupt)?;
        Ok(Some(entry))
    }

    /// Temp file, write, fsync, rename, and for a durable write fsync the
    /// directory.
    fn write_entry(
        &self,
        entry: &InstanceEntry,
        durability: Durability,
    ) -> Result<(), JournalError> {
        let path = self.path_of(&entry.instance);
        let encode_err = |source| JournalError::Encode {
            instance: entry.instance.clone(),
            source,
        };
        let on_disk = OnDisk {
            entry,
            checksum: checksum(entry).map_err(encode_err)?,
        };
        let bytes = serde_json::to_vec_pretty(&on_disk).map_err(encode_err)?;
        let temp = self.dir.join(temp_name(&file_name(&entry.instance)));
        let write_err = |source| JournalError::Write {
            path: path.clone(),
            source,
        };
        let written = (|| {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&temp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            fs::rename(&temp, &path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(write_err(e));
        }
        match durability {
            Durability::Durable => fsync_dir(&self.dir).map_err(write_err),
            Durability::Ordered => Ok(()),
        }
    }

    /// Runs `f` holding the instance's lock.
    fn locked<T>(&self, instance: &InstanceKey, f: impl FnOnce() -> T) -> T {
        let lock = self
            .locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(instance.clone())
            .or_default()
            .clone();
        // The mutex guards `()`: a poisoned lock carries no broken state.
        let _guard = lock.lock().unwrap_or_else(PoisonError::into_inner);
        f()
    }
}

/// `<disk name>.json`.
fn file_name(instance: &InstanceKey) -> String {
    format!("{}.json", DiskName::of(instance))
}

/// The instance a journal file says it is about, however broken the rest.
fn named_in(path: &Path) -> Option<InstanceKey> {
    #[derive(Deserialize)]
    struct Named {
        instance: InstanceKey,
    }
    let bytes = fs::read(path).ok()?;
    serde_json::from_slice::<Named>(&bytes)
        .ok()
        .map(|named| named.instance)
}

/// A journal file: the entry and the checksum of its content.
#[derive(Serialize)]
struct OnDisk<'a> {
    #[serde(flatten)]
    entry: &'a InstanceEntry,
    checksum: String,
}

/// The name of the checksum member of a journal file.
const CHECKSUM_FIELD: &str = "checksum";

/// Checks the file's checksum against the entry read from it. A file
/// without one (written before checksums) is accepted only when it holds
/// nothing but the entry's own members: a checksum member whose name was
/// damaged shows up as an unknown member, and so cannot pass for one.
fn verify_checksum(bytes: &[u8], entry: &InstanceEntry) -> Result<(), String> {
    let file: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|e| format!("not a journal entry: {e}"))?;
    match file.get(CHECKSUM_FIELD) {
        Some(serde_json::Value::String(recorded)) => {
            let actual = checksum(entry).map_err(|e| format!("cannot re-encode it: {e}"))?;
            if actual != *recorded {
                return Err(format!(
                    "its content does not match its checksum (sha256 {actual}, recorded {recorded}): damaged on disk"
                ));
            }
            Ok(())
        }
        Some(other) => Err(format!("its checksum is not a string: {other}")),
        None => {
            let own =
                serde_json::to_value(entry).map_err(|e| format!("cannot re-encode it: {e}"))?;
            match file.keys().find(|key| own.get(key.as_str()).is_none()) {
                Some(unknown) => Err(format!(
                    "it has no checksum and an unknown member {unknown:?}: damaged on disk"
                )),
                None => Ok(()),
            }
        }
    }
}

/// The sha256 of the entry's compact JSON: the same for the entry however
/// the file around it is laid out.
fn checksum(entry: &InstanceEntry) -> Result<String, serde_json::Error> {
    use sha2::Digest;
    let canonical = serde_json::to_vec(entry)?;
    Ok(hex::encode(sha2::Sha256::digest(&canonical)))
}

fn is_temp_name(name: &str) -> bool {
    name.contains(".json.tmp-")
}

fn is_quarantined_name(name: &str) -> bool {
    name.contains(".json.corrupt-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase_names_are_the_names_on_file() {
        let phases = [
            Phase::Admitted,
            Phase::ParentRaised {
                saved: SavedLimits::default(),
            },
            Phase::Spawning,
            Phase::Spawned { pid: 1 },
            Phase::Healthy,
            Phase::Switched,
            Phase::IncumbentStopped,
            Phase::Finished,
        ];
        for phase in phases {
            let json = serde_json::to_value(&phase).expect("serializes");
            assert_eq!(json["name"], phase.name(), "{json}");
        }
    }
}
