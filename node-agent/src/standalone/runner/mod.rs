//! The standalone loop: directory changes, engine results and timers in;
//! plans, attempts, state and status files out. One task owns all of it, so
//! no instance's bookkeeping is ever touched from two places.
//!
//! The loop and an instance's life (start, stop, forget) are here; what
//! comes in is in `intake` (the saved state, the manifests), what is decided
//! in `plan`, and what goes out in `report` (outcomes folded in, state saved,
//! status documents written).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use genswap_core::scheduler;
use genswap_crds::{
    ConditionType, InstanceGeneration, SwapAttempt, SwapAttemptStatus, set_condition,
};
use genswap_runtime::prometheus::Prometheus;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::files::{blocking, remove_if_exists, replace_file};
use super::manifests::{self, ManifestFile, Parsed};
use super::state::{HISTORY_KEPT, InstanceState, StateStore};
use super::status::{self, AttemptReport, StatusDocument, reasons};
use super::watch::{DirChange, DirWatch};
use super::{STATUS_SUBDIR, StandaloneConfig, StandaloneError};
use crate::attempt_status::{self, time_of};
use crate::engine::{
    Attempt, Cancel, Engine, EngineError, ServingChange, SupervisorEvent, SwapResult,
};
use crate::gate::{InstanceKey, NewestRevisionGate};

mod intake;
mod plan;
mod report;

/// A plan that creates attempts is followed by another, until one creates
/// none; this bounds the chain should the scheduler ever keep creating.
const MAX_PLANS_PER_CHANGE: usize = 4;
/// A stop that failed is tried again after this long.
const STOP_RETRY: Duration = Duration::from_secs(5);
/// How soon an instance whose state could not be written is tried again.
const STATE_RETRY: Duration = Duration::from_secs(5);
/// The `Stalled` reason while the state cannot be written (a full disk,
/// say): a human must make room.
const STATE_UNWRITABLE: &str = "StateUnwritable";

/// One instance: the file it comes from, the object the scheduler plans,
/// its attempts, and what runs for it now.
struct Instance {
    file: String,
    ig: InstanceGeneration,
    attempts: Vec<SwapAttempt>,
    /// Finished attempts the scheduler deleted, oldest first.
    history: Vec<AttemptReport>,
    running: Option<InFlight>,
    requeue_at: Option<Instant>,
    /// Its file no longer validates (why, and since when); the last valid
    /// spec stays in force.
    invalid: Option<(String, Time)>,
    removal: Removal,
    /// The state last written, so an unchanged one is not written again.
    saved: Option<InstanceState>,
    /// The state could not be written (why, since when): no attempt starts
    /// and no outcome that is kept nowhere is shown until it can.
    unkept: Option<(String, Time)>,
}

/// The attempt the engine runs for an instance.
struct InFlight {
    sched_rev: i64,
    cancel: Cancel,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Removal {
    No,
    /// Its file is gone: the attempt in flight is being cancelled.
    Requested,
    /// The engine is stopping its generations.
    Stopping,
}

impl Instance {
    fn generation(&self) -> i64 {
        self.ig.metadata.generation.unwrap_or(1)
    }

    /// What is in memory is what the state file holds.
    fn is_saved(&self, key: &InstanceKey) -> bool {
        self.saved.as_ref() == Some(&self.state(key))
    }

    fn state(&self, key: &InstanceKey) -> InstanceState {
        InstanceState {
            instance: key.clone(),
            file: self.file.clone(),
            generation: self.generation(),
            spec: self.ig.spec.clone(),
            status: self.ig.status.clone().unwrap_or_default(),
            attempts: self.attempts.clone(),
            history: self.history.clone(),
        }
    }
}

/// What the tasks the loop starts report back.
enum Msg {
    Finished {
        key: InstanceKey,
        sched_rev: i64,
        result: Box<SwapResult>,
        /// The `serving` block the attempt starts its lineage with, if any.
        serving: Option<Box<ServingChange>>,
    },
    /// A stage-only attempt ended (`rollout.prestage`).
    Staged {
        key: InstanceKey,
        sched_rev: i64,
        status: Box<SwapAttemptStatus>,
    },
    Stopped {
        key: InstanceKey,
        result: Result<Option<Duration>, EngineError>,
    },
    Supervisor(SupervisorEvent),
}

pub(super) struct Runner {
    engine: Arc<Engine>,
    gate: Arc<NewestRevisionGate>,
    dir: PathBuf,
    status_dir: PathBuf,
    store: StateStore,
    node: Node,
    stop_on_exit: bool,
    prometheus: Option<Prometheus>,
    watch: DirWatch,
    files: BTreeMap<String, ManifestFile>,
    instances: BTreeMap<InstanceKey, Instance>,
    /// Status files written, by manifest file name.
    written: BTreeMap<String, StatusDocument>,
    /// Journal outcomes read at start, acknowledged once the first status
    /// files are written.
    pending_acks: Vec<(InstanceKey, i64)>,
    tx: mpsc::UnboundedSender<Msg>,
    rx: mpsc::UnboundedReceiver<Msg>,
    shutting_down: bool,
    directory_gone: bool,
}

impl Runner {
    /// Checks the directory, loads the state, folds in outcomes the journal
    /// kept, and starts watching.
    pub(super) async fn start(
        engine: Arc<Engine>,
        gate: Arc<NewestRevisionGate>,
        state_dir: &Path,
        config: StandaloneConfig,
    ) -> Result<Runner, StandaloneError> {
        let dir = config.dir.clone();
        match fs::metadata(&dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(StandaloneError::Dir {
                    path: dir,
                    reason: "it is not a directory".into(),
                });
            }
            Err(error) => {
                return Err(StandaloneError::Dir {
                    path: dir,
                    reason: error.to_string(),
                });
            }
        }
        let status_dir = dir.join(STATUS_SUBDIR);
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&status_dir)
            .or_else(|error| match error.kind() {
                std::io::ErrorKind::AlreadyExists if status_dir.is_dir() => Ok(()),
                _ => Err(error),
            })
            .map_err(|source| StandaloneError::StatusDir {
                path: status_dir.clone(),
                source,
            })?;
        // The watch goes in before the first scan, so no change between the
        // two is missed.
        let watch = DirWatch::new(&dir).map_err(|source| StandaloneError::Watch {
            path: dir.clone(),
            source,
        })?;
        let store = StateStore::open(state_dir)?;
        let (tx, rx) = mpsc::unbounded_channel();
        // The caller holds the node: standalone mode is the only intake.
        gate.set_owner(true);
        let mut runner = Runner {
            engine,
            gate,
            dir,
            status_dir,
            store,
            node: config.node.node(),
            stop_on_exit: config.stop_on_exit,
            prometheus: config.prometheus,
            watch,
            files: BTreeMap::new(),
            instances: BTreeMap::new(),
            written: BTreeMap::new(),
            pending_acks: Vec::new(),
            tx,
            rx,
            shutting_down: false,
            directory_gone: false,
        };
        runner.load_state().await?;
        Ok(runner)
    }

    /// The loop. Returns once shutdown finished or the directory went away.
    pub(super) async fn run(
        mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), StandaloneError> {
        self.rescan().await;
        let keys: Vec<InstanceKey> = self.instances.keys().cloned().collect();
        for key in keys {
            self.replan(&key).await;
        }
        self.remove_stale_status_files().await;
        for (key, sched_rev) in std::mem::take(&mut self.pending_acks) {
            self.acknowledge(&key, sched_rev).await;
        }

        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            if self.shutting_down && self.quiet() {
                break;
            }
            let due = self.instances.values().filter_map(|i| i.requeue_at).min();
            tokio::select! {
                () = &mut shutdown, if !self.shutting_down => {
                    tracing::info!("standalone mode is shutting down");
                    self.begin_shutdown("standalone mode is shutting down");
                }
                change = self.watch.changed(), if !self.shutting_down => match change {
                    Ok(DirChange::Entries) => self.rescan().await,
                    Ok(DirChange::DirectoryGone) => {
                        tracing::error!(dir = %self.dir.display(), "the manifest directory was deleted or moved away");
                        self.directory_gone = true;
                        self.begin_shutdown("the manifest directory went away");
                    }
                    Err(error) => {
                        tracing::error!(dir = %self.dir.display(), %error, "reading inotify events failed; rescanning");
                        self.rescan().await;
                    }
                },
                Some(msg) = self.rx.recv() => self.handle(msg).await,
                () = sleep_until(due), if due.is_some() => self.requeue_due().await,
            }
        }
        if self.directory_gone {
            return Err(StandaloneError::DirectoryGone { path: self.dir });
        }
        Ok(())
    }

    /// Nothing runs and nothing is being stopped.
    fn quiet(&self) -> bool {
        self.instances
            .values()
            .all(|i| i.running.is_none() && i.removal == Removal::No)
    }

    fn begin_shutdown(&mut self, why: &str) {
        self.shutting_down = true;
        self.gate.set_shutting_down();
        let keys: Vec<InstanceKey> = self.instances.keys().cloned().collect();
        for key in keys {
            if self.stop_on_exit {
                self.request_removal(&key, why);
            } else if let Some(running) = self.instances.get(&key).and_then(|i| i.running.as_ref())
            {
                running.cancel.cancel(why);
            }
        }
    }

    async fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Finished {
                key,
                sched_rev,
                result,
                serving,
            } => self.finished(key, sched_rev, *result, serving).await,
            Msg::Staged {
                key,
                sched_rev,
                status,
            } => self.staged(key, sched_rev, *status).await,
            Msg::Stopped { key, result } => self.stopped(key, result).await,
            Msg::Supervisor(event) => self.supervised(event).await,
        }
    }

    /// Where the engine's supervisor tells this runner what it did.
    pub(super) fn supervisor_events(&self) -> impl Fn(SupervisorEvent) + Send + Sync + 'static {
        let tx = self.tx.clone();
        move |event| {
            let _ = tx.send(Msg::Supervisor(event));
        }
    }

    /// An exit, a restart or a lineage's new state: the state goes into the
    /// `serving` block of the attempt that installed the lineage, and the
    /// instance is planned again (its status file then says it).
    async fn supervised(&mut self, event: SupervisorEvent) {
        crate::engine::log_event(&event);
        let SupervisorEvent::Serving(change) = event else {
            return;
        };
        let Some(instance) = self.instances.get_mut(&change.instance) else {
            return;
        };
        let sched_rev = change.attempt().sched_rev;
        let Some(status) = instance
            .attempts
            .iter_mut()
            .find(|a| a.spec.sched_rev == sched_rev)
            .and_then(|a| a.status.as_mut())
        else {
            return;
        };
        status.serving = Some(attempt_status::serving_status(
            &change.supervised,
            change.last_exit.as_ref(),
            &change.sidecars,
        ));
        self.replan(&change.instance).await;
    }

    /// The file of `key` is gone (or standalone mode stops with
    /// stop-on-exit): cancel what runs, then stop its generations.
    fn request_removal(&mut self, key: &InstanceKey, why: &str) {
        let Some(instance) = self.instances.get_mut(key) else {
            return;
        };
        if instance.removal != Removal::No {
            return;
        }
        instance.removal = Removal::Requested;
        instance.requeue_at = None;
        match &instance.running {
            Some(running) => running.cancel.cancel(why),
            None => self.begin_stop(key),
        }
    }

    fn begin_stop(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.get_mut(key) else {
            return;
        };
        instance.removal = Removal::Stopping;
        instance.requeue_at = None;
        let stop = instance.ig.spec.stop.clone();
        let engine = self.engine.clone();
        let tx = self.tx.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let result = engine.stop_instance(&key, &stop).await;
            let _ = tx.send(Msg::Stopped { key, result });
        });
    }

    async fn stopped(&mut self, key: InstanceKey, result: Result<Option<Duration>, EngineError>) {
        match result {
            Ok(drain) => {
                tracing::info!(instance = %key, drain_ms = ?drain.map(|d| d.as_millis()), "instance stopped");
                self.forget(&key).await;
                self.rescan().await;
            }
            Err(error) if self.shutting_down => {
                tracing::error!(instance = %key, %error, "the instance could not be stopped; its state is kept");
                self.instances.remove(&key);
            }
            Err(error) => {
                tracing::error!(instance = %key, %error, "the instance could not be stopped; trying again");
                if let Some(instance) = self.instances.get_mut(&key) {
                    instance.removal = Removal::Requested;
                    instance.requeue_at = Some(Instant::now() + STOP_RETRY);
                }
            }
        }
    }

    /// Removes what the stop left of an instance: its journal, state and
    /// status files, and the gate's memory.
    async fn forget(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.remove(key) else {
            return;
        };
        self.gate.forget(key);
        self.engine
            .keep_prestaged(&format!("instance {key}"), Vec::new());
        let engine = self.engine.clone();
        let store = self.store.clone();
        let owned = key.clone();
        // The stop removed its cgroup and run dir already.
        blocking(move || {
            if let Err(error) = engine.journal().remove_instance(&owned) {
                tracing::warn!(instance = %owned, %error, "the instance's journal file could not be removed");
            }
            if let Err(error) = store.remove(&owned) {
                tracing::warn!(instance = %owned, %error, "the instance's state file could not be removed");
            }
        })
        .await;
        // On stop-on-exit nothing serves any more, so no status may say it
        // does; otherwise the file may now hold something else, whose status
        // a rescan writes.
        if self.shutting_down || !self.files.contains_key(&instance.file) {
            self.remove_status_file(&instance.file).await;
        }
    }
}

/// Sleeps until `due`, or forever without one (the select arm is disabled
/// then).
async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}
