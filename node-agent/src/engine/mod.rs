//! The swap engine: one attempt moves one instance on this node to a new
//! generation (SPEC 5.2 to 5.8 and 6).
//!
//! It knows nothing of Kubernetes. An adapter hands [`Engine::swap`] an
//! [`Attempt`] (the SwapAttempt's spec), an [`AttemptGate`] and a [`Cancel`]
//! token, and gets a [`SwapResult`] back: what the agent writes to the
//! SwapAttempt's status. `swap` returns when the attempt is over, an overlap's
//! retiring generation drained and proven stopped included.
//!
//! # Modes
//!
//! The attempt runs in its *effective mode* ([`effective_mode`]): an overlap
//! on a fixed socket layout, with a hold demand, or of a worker runs as a
//! hold. The effective mode is the first thing written to the intent journal
//! and is reported in [`SwapResult::effective_mode`].
//!
//! - **Overlap** (SPEC 5.5): stage → admit → raise → journal → spawn →
//!   health → settle → switch → retire. The successor starts beside the
//!   incumbent in its own `gen-<N>` cgroup and socket, and takes over
//!   `current.sock` only once healthy; any failure before the switch stops
//!   it with proof, and the incumbent keeps serving.
//! - **Hold** (SPEC 5.6): stage → admit → journal → stop → spawn → health →
//!   settle → switch. A build failure after the incumbent stopped is `down`.
//! - **Worker**: a hold whose new build may exit 0 inside the settle window,
//!   a one-shot's success (`done`, `clean_exit`). Workers are always watched
//!   for the settle window.
//! - **Install** (no generation serves): the effective mode with nothing to
//!   raise, stop or retire. A failed install stopped nothing, so it is
//!   `failed`, never `down`.
//!
//! # The gate, the classifier and `executed`
//!
//! The gate is asked at admission, right before the exec, and at the switch
//! (overlap); a refusal ends the attempt `abandoned`, and anything of the
//! build that already runs is stopped with proof. Every step's error goes
//! through the one classifier, [`crate::classify::classify`]; only a `failed`
//! step is the build's fault. [`SwapResult::executed`] is `false` only when it
//! is proven that no process of the build started.
//!
//! # Concurrency
//!
//! One attempt per instance at a time (a second one is refused as
//! mid-operation); different instances swap in parallel. The per-instance
//! state lives behind a `std::sync::Mutex` that is never held across an
//! await. End an attempt early with its [`Cancel`] token, not by dropping the
//! future: a dropped swap leaves whatever it had started to crash recovery.
//!
//! The design, the step tables and the figures are in `docs/ENGINE.md`.
mod cancel;
mod flow;
mod hold;
mod lifecycle;
mod liveness;
mod overlap;
mod parts;
mod recover;
mod sidecars;
mod supervise;
mod types;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use genswap_crds::{InstanceKind, StopSpec};
use thiserror::Error;

pub use cancel::Cancel;
pub use recover::{
    InstanceRecovery, RecoveredAttempt, RecoveryError, RecoveryReport, StoppedGeneration,
    UntrackedCgroup,
};
pub use supervise::{
    GenerationExit, RestartBackoff, ServingChange, Supervisor, SupervisorEvent, log_event,
};
pub use types::{Attempt, Step, StepRecord, SwapResult, effective_mode};

use crate::cgroup::{Cgroup, CgroupError, CgroupManager, Tier};
use crate::gate::{AttemptGate, InstanceKey};
use crate::journal::{GenerationRecord, Journal, JournalError};
use crate::logs::LogSink;
use crate::spawn::Spawned;
use crate::switch::RunLayout;
use genswap_store::Stager;

/// The engine's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Instances may run as uid 0.
    pub allow_root: bool,
    /// `false` is `--swap=off`: every attempt is abandoned and nothing is
    /// spawned (restarts included).
    pub swaps_on: bool,
    /// How restarts of exited generations back off.
    pub restart_backoff: RestartBackoff,
    /// `steered`: TCP and UDP listeners get a socket per generation where the
    /// kernel allows it (SPEC 6.3); `shared`: never (SPEC 6.2).
    pub listener_handover: genswap_crds::ListenerHandover,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            allow_root: false,
            swaps_on: true,
            restart_backoff: RestartBackoff::default(),
            listener_handover: genswap_crds::ListenerHandover::Steered,
        }
    }
}

/// The host parts the engine composes.
pub struct EngineParts {
    /// The cgroup v2 subtree instances run in.
    pub cgroups: CgroupManager,
    /// Where the instances' sockets and `current.sock` live.
    pub layout: RunLayout,
    /// The artifact store and its staging rules.
    pub stager: Stager,
    /// The per-instance intent journal.
    pub journal: Journal,
    /// Where generations' stdout and stderr go.
    pub logs: LogSink,
}

/// What serves an instance now, as the engine knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingGeneration {
    /// Its generation N.
    pub generation: u64,
    /// The build id.
    pub build: String,
    /// The artifact's sha256.
    pub sha256: String,
    /// The store path it was executed from.
    pub store_path: PathBuf,
    /// Its own socket, `gen-<N>.sock`.
    pub socket: PathBuf,
    /// Its cgroup directory.
    pub cgroup: PathBuf,
    /// Its main process.
    pub pid: u32,
    /// How it is stopped: the stop settings of the attempt that started it
    /// (the defaults for a generation journaled before they were recorded).
    pub stop: StopSpec,
}

/// Why an engine operation outside an attempt failed.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The instance is mid-operation.
    #[error("{instance} is mid-operation: an attempt of it is running")]
    Busy {
        /// The instance.
        instance: InstanceKey,
    },
    /// Its generation could not be stopped with proof.
    #[error("stopping {instance}: {source}")]
    Stop {
        /// The instance.
        instance: InstanceKey,
        /// Why.
        #[source]
        source: CgroupError,
    },
    /// The journal could not record that nothing serves.
    #[error("journaling that {instance} stopped: {source}")]
    Journal {
        /// The instance.
        instance: InstanceKey,
        /// Why.
        #[source]
        source: JournalError,
    },
}

/// One running generation that the engine supervises: started by it, or
/// adopted by crash recovery.
#[derive(Debug)]
pub(crate) struct Running {
    /// N, build, digest, store path, cgroup and socket, as journaled.
    pub(crate) record: GenerationRecord,
    pub(crate) cgroup: Cgroup,
    pub(crate) tier: Tier,
    pub(crate) kind: InstanceKind,
    pub(crate) process: Process,
    /// Its `NOTIFY_SOCKET`, while this agent watches it (a `notify` probe).
    pub(crate) notify: Option<crate::notify::NotifyWatch>,
    /// Its liveness probe between attempts, when its spec has one.
    pub(crate) liveness: Option<std::sync::Arc<liveness::Liveness>>,
    /// The task probing it, while it runs.
    pub(crate) liveness_task: Option<liveness::AbortOnDrop>,
    /// Its `lifecycle.preStop` hook, run before its stop signal.
    pub(crate) pre_stop: Option<lifecycle::PreStop>,
    /// Its `process.pidFile`, until its start has handed over to the
    /// process the file names.
    pub(crate) pid_file: Option<PathBuf>,
    /// Its sidecars, once it serves (SPEC 5.13).
    pub(crate) sidecars: Option<sidecars::Sidecars>,
}

/// A generation's main process.
#[derive(Debug)]
pub(crate) enum Process {
    /// Started by this agent: its exit is awaited through the child handle
    /// and its exit status is known.
    Spawned(Box<Spawned>),
    /// Found running after an agent restart. It is not this agent's child,
    /// so its exit shows only as its cgroup emptying (`populated 0`), and
    /// its exit status is unknown.
    Adopted {
        /// The main process as found in the cgroup.
        pid: u32,
    },
    /// Named by `process.pidFile` once the started process exited 0
    /// (systemd's `Type=forking`). Not this agent's child either: its exit
    /// shows on its pidfd, and its exit status is unknown.
    Forked {
        /// The pid the file named.
        pid: u32,
    },
}

impl Process {
    /// The main process's pid.
    pub(crate) fn pid(&self) -> u32 {
        match self {
            Process::Spawned(child) => child.pid(),
            Process::Adopted { pid } | Process::Forked { pid } => *pid,
        }
    }
}

impl Running {
    fn serving(&self) -> ServingGeneration {
        ServingGeneration {
            generation: self.record.n,
            build: self.record.build.clone(),
            sha256: self.record.sha256.clone(),
            store_path: self.record.store_path.clone().unwrap_or_default(),
            socket: self.record.socket.clone(),
            cgroup: self.record.cgroup.clone(),
            pid: self.process.pid(),
            stop: self.record.stop.clone().unwrap_or_default(),
        }
    }
}

/// The engine's memory of one instance.
#[derive(Debug, Default)]
struct InstanceState {
    /// An attempt (or a stop) of this instance is running.
    busy: bool,
    /// The serving generation. While busy, the attempt holds it instead
    /// (see [`Claim`]) and this is `None`.
    serving: Option<Running>,
    /// What serves, kept readable while an attempt holds the generation.
    info: Option<ServingGeneration>,
    /// The generation whose exit a task watches (see `supervise`).
    watched: Option<u64>,
}

/// The swap engine of one node. See the module docs.
pub struct Engine {
    cgroups: CgroupManager,
    layout: RunLayout,
    stager: Stager,
    journal: Arc<Journal>,
    logs: LogSink,
    config: EngineConfig,
    instances: Mutex<HashMap<InstanceKey, InstanceState>>,
    /// The listening sockets held for instances (SPEC 6.2).
    listeners: crate::listeners::Listeners,
    notices: supervise::Notices,
    /// The serving generations' sidecars, as their tasks post them.
    sidecar_board: sidecars::Board,
    /// The build digests of the attempts running now, by a token each:
    /// staged, or about to be, before the journal names them, and kept by
    /// the store's retention meanwhile.
    staging: Mutex<(u64, HashMap<u64, Vec<String>>)>,
    /// Build digests staged ahead of their swap (`stageOnly` attempts), by
    /// the holder that asked: kept by retention until it lets go, since
    /// no journal names them before the swap.
    prestaged: Mutex<HashMap<String, Vec<String>>>,
}

impl Engine {
    /// An engine over these host parts.
    pub fn new(parts: EngineParts, config: EngineConfig) -> Self {
        // The keepers are the shims' program run as another command.
        let keeper = crate::listener_keeper::KeeperSite::new(
            parts.logs.settings().helper.clone(),
            &parts.cgroups,
        );
        let listeners =
            crate::listeners::Listeners::with_keeper(keeper).handover(config.listener_handover);
        Self {
            cgroups: parts.cgroups,
            layout: parts.layout,
            stager: parts.stager,
            journal: Arc::new(parts.journal),
            logs: parts.logs,
            config,
            instances: Mutex::new(HashMap::new()),
            listeners,
            notices: supervise::Notices::new(),
            sidecar_board: sidecars::Board::default(),
            staging: Mutex::new((0, HashMap::new())),
            prestaged: Mutex::new(HashMap::new()),
        }
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The run-dir layout (where `current.sock` of an instance is).
    pub fn layout(&self) -> &RunLayout {
        &self.layout
    }

    /// The intent journal: the adapter reads pending outcomes from it and
    /// acknowledges them once the API server accepted them.
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The kernel's drop counts of the UDP listeners' sockets.
    pub fn datagram_drops(&self) -> Vec<crate::metrics::DatagramDrops> {
        self.listeners.datagram_drops()
    }

    /// Where generations' output goes.
    pub fn logs(&self) -> &LogSink {
        &self.logs
    }

    /// Ends the log shim started ahead as the agent stops (see
    /// [`LogSink::close`]), off the runtime's threads: it may wait for one
    /// being started.
    pub async fn close_logs(&self) {
        let logs = self.logs.clone();
        if let Err(error) = tokio::task::spawn_blocking(move || logs.close()).await {
            tracing::warn!(%error, "closing the log sink failed");
        }
    }

    /// The cgroup subtree the engine runs instances in.
    pub fn cgroups(&self) -> &CgroupManager {
        &self.cgroups
    }

    /// What serves `instance` now, if anything.
    pub fn serving(&self, instance: &InstanceKey) -> Option<ServingGeneration> {
        self.lock_instances()
            .get(instance)
            .and_then(|state| state.info.clone())
    }

    /// The sidecars of what serves `instance` (SPEC 5.13), as their
    /// supervision last posted them; empty without any.
    pub fn sidecars(&self, instance: &InstanceKey) -> Vec<genswap_crds::SidecarStatus> {
        self.sidecar_board.of(instance)
    }

    /// Starts the sidecars `spec` names for what serves `instance`, unless
    /// they run: what a recovery that adopted it does.
    fn start_serving_sidecars(&self, instance: &InstanceKey, spec: &genswap_crds::SwapAttemptSpec) {
        let mut instances = self.lock_instances();
        let Some(running) = instances
            .get_mut(instance)
            .and_then(|state| state.serving.as_mut())
        else {
            return;
        };
        if running.sidecars.is_none() {
            running.sidecars = sidecars::Sidecars::start(self, instance, spec, running);
        }
    }

    /// The store builds are staged into, for staging ahead of an attempt
    /// (`rollout.prestage`).
    pub fn stager(&self) -> &Stager {
        &self.stager
    }

    /// Keeps `sha256s`, staged ahead of their swap, from the store's
    /// retention for `holder` (a stage-only attempt, or an instance's
    /// asks); none lets go of what `holder` kept.
    pub fn keep_prestaged(&self, holder: &str, sha256s: Vec<String>) {
        let mut prestaged = self
            .prestaged
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if sha256s.is_empty() {
            prestaged.remove(holder);
        } else {
            prestaged.insert(holder.to_string(), sha256s);
        }
    }

    /// Every instance the engine has a serving generation for.
    pub fn instances(&self) -> Vec<InstanceKey> {
        let mut keys: Vec<InstanceKey> = self
            .lock_instances()
            .iter()
            .filter(|(_, state)| state.info.is_some())
            .map(|(key, _)| key.clone())
            .collect();
        keys.sort();
        keys
    }

    /// Runs one attempt to its end. See the module docs.
    pub async fn swap(
        &self,
        attempt: &Attempt,
        gate: &dyn AttemptGate,
        cancel: &Cancel,
    ) -> SwapResult {
        let token = self.hold_builds(&attempt.spec);
        let result = flow::run(self, attempt, gate, cancel).await;
        self.release_builds(token);
        // After each outcome, the store keeps what retention says.
        self.collect_store().await;
        result
    }

    fn hold_builds(&self, spec: &genswap_crds::SwapAttemptSpec) -> u64 {
        let mut staging = self.staging.lock().unwrap_or_else(PoisonError::into_inner);
        staging.0 += 1;
        let token = staging.0;
        staging.1.insert(token, crate::journal::builds_of(spec));
        token
    }

    fn release_builds(&self, token: u64) {
        self.staging
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .remove(&token);
    }

    /// The store's retention (SPEC 5.14): removes the entries that no
    /// generation runs or may run again (what the journal names: serving,
    /// retiring and starting generations, each lineage's builds and the one
    /// before it), beyond the newest `--store-keep` within
    /// `--store-max-bytes`. With a journal file that cannot be read,
    /// nothing is removed: what it names is not known.
    pub async fn collect_store(&self) -> Option<genswap_store::RetentionReport> {
        let mut protected: std::collections::HashSet<String> = self
            .staging
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .1
            .values()
            .flatten()
            .cloned()
            .collect();
        protected.extend(
            self.prestaged
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .values()
                .flatten()
                .cloned(),
        );
        protected.extend(
            self.lock_instances()
                .values()
                .filter_map(|state| state.info.as_ref().map(|info| info.sha256.clone())),
        );
        let journal = Arc::clone(&self.journal);
        let stager = self.stager.clone();
        let collected = parts::blocking(move || {
            let (entries, corrupt) = journal.load_all().map_err(|e| e.to_string())?;
            if let Some(bad) = corrupt.first() {
                return Err(format!(
                    "the journal file {} cannot be read, so what it keeps is not known",
                    bad.path.display()
                ));
            }
            for entry in entries {
                protected.extend(entry.builds_in_use());
            }
            stager.collect(&protected).map_err(|e| e.to_string())
        })
        .await;
        match collected {
            Ok(report) => {
                if !report.removed.is_empty() {
                    tracing::info!(removed = ?report.removed, freed_bytes = report.freed_bytes, kept = report.kept, kept_bytes = report.kept_bytes, "the store removed builds nothing keeps");
                }
                for failure in &report.failed {
                    tracing::warn!(%failure, "the store could not remove a build");
                }
                Some(report)
            }
            Err(error) => {
                tracing::warn!(%error, "the store keeps everything this time");
                None
            }
        }
    }

    /// Stops `instance`'s serving generation with proof of exit (its
    /// InstanceGeneration was deleted, or the agent tears it down), removes
    /// its cgroup, socket and `current.sock`, then the instance's cgroup and
    /// run dir, and journals that nothing serves. Returns the drain time;
    /// `None` when nothing served.
    pub async fn stop_instance(
        &self,
        instance: &InstanceKey,
        stop: &StopSpec,
    ) -> Result<Option<Duration>, EngineError> {
        let mut claim = self.claim(instance).ok_or_else(|| EngineError::Busy {
            instance: instance.clone(),
        })?;
        let Some(running) = claim.serving.take() else {
            // Nothing runs (it exited, a restart may be owed): nothing is
            // restarted either from now on.
            self.listeners.release(instance).await;
            self.journal_stopped(instance).await?;
            parts::remove_empty_instance(self, instance);
            return Ok(None);
        };
        let drain = match parts::stop_generation(running, stop).await {
            Ok(report) => report.drain,
            Err((running, source)) => {
                claim.serving = Some(running);
                return Err(EngineError::Stop {
                    instance: instance.clone(),
                    source,
                });
            }
        };
        parts::remove_current_link(&self.layout, instance);
        self.listeners.release(instance).await;
        self.journal_stopped(instance).await?;
        parts::remove_empty_instance(self, instance);
        Ok(Some(drain))
    }

    /// Journals that nothing serves `instance` by intent, and nothing is
    /// to be restarted.
    async fn journal_stopped(&self, instance: &InstanceKey) -> Result<(), EngineError> {
        let journal = Arc::clone(&self.journal);
        let key = instance.clone();
        parts::blocking(move || journal.stopped(&key))
            .await
            .map_err(|source| EngineError::Journal {
                instance: instance.clone(),
                source,
            })
    }

    /// Marks `instance` busy and takes its serving generation for the
    /// caller; `None` when it is already busy.
    fn claim(&self, instance: &InstanceKey) -> Option<Claim<'_>> {
        let mut instances = self.lock_instances();
        let state = instances.entry(instance.clone()).or_default();
        if state.busy {
            return None;
        }
        state.busy = true;
        let serving = state.serving.take();
        Some(Claim {
            engine: self,
            instance: instance.clone(),
            serving,
        })
    }

    /// Watches the exit of what `state` serves, unless that is watched.
    fn watch_serving(&self, instance: &InstanceKey, state: &mut InstanceState) {
        if let Some(running) = &mut state.serving {
            self.notices.probe_liveness(instance, running);
            if state.watched != Some(running.record.n) {
                self.notices.watch(instance, running);
                state.watched = Some(running.record.n);
            }
        }
    }

    /// The watch of `generation` fired: a later hand-back watches again.
    fn forget_watch(&self, instance: &InstanceKey, generation: u64) {
        if let Some(state) = self.lock_instances().get_mut(instance)
            && state.watched == Some(generation)
        {
            state.watched = None;
        }
    }

    /// The map holds plain data that every writer leaves consistent, so a
    /// poisoned lock is still safe to use.
    fn lock_instances(&self) -> MutexGuard<'_, HashMap<InstanceKey, InstanceState>> {
        self.instances
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// An instance marked busy, holding its serving generation. Dropping it
/// hands whatever `serving` holds back to the engine and clears the mark, on
/// every exit path.
struct Claim<'a> {
    engine: &'a Engine,
    instance: InstanceKey,
    serving: Option<Running>,
}

impl Claim<'_> {
    /// Publishes what serves now without ending the claim, so
    /// [`Engine::serving`] answers right after a switch.
    fn publish(&self) {
        let info = self.serving.as_ref().map(Running::serving);
        if let Some(state) = self.engine.lock_instances().get_mut(&self.instance) {
            state.info = info;
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let serving = self.serving.take();
        let mut instances = self.engine.lock_instances();
        let state = instances.entry(self.instance.clone()).or_default();
        state.info = serving.as_ref().map(Running::serving);
        state.serving = serving;
        state.busy = false;
        self.engine.watch_serving(&self.instance, state);
        if state.serving.is_none() {
            self.engine.notices.idle(&self.instance);
        }
    }
}
