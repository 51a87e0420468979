//! The standalone loop: directory changes, engine results and timers in;
//! plans, attempts, state and status files out. One task owns all of it, so
//! no instance's bookkeeping is ever touched from two places.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use genswap_core::scheduler;
use genswap_crds::{ConditionType, InstanceGeneration, SwapAttempt, set_condition};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::files::{blocking, remove_if_exists, replace_file};
use super::manifests::{self, ManifestFile, Parsed};
use super::state::{InstanceState, StateStore};
use super::status::{self, StatusDocument, reasons};
use super::watch::{DirChange, DirWatch};
use super::{STATUS_SUBDIR, StandaloneConfig, StandaloneError};
use crate::attempt_status::{self, time_of};
use crate::engine::{
    Attempt, Cancel, Engine, EngineError, ServingChange, SupervisorEvent, SwapResult,
};
use crate::gate::{InstanceKey, NewestRevisionGate};

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

    /// Loads every instance's state and the journal's unacknowledged
    /// outcomes.
    async fn load_state(&mut self) -> Result<(), StandaloneError> {
        let store = self.store.clone();
        let (states, broken) = blocking(move || store.load_all()).await?;
        for error in broken {
            tracing::error!(%error, "a standalone state file cannot be read; its instance starts afresh when its manifest is seen");
        }
        let journal_engine = self.engine.clone();
        if let Err(error) = blocking(move || journal_engine.journal().remove_temp_files()).await {
            tracing::warn!(%error, "leftover journal temp files could not be removed");
        }
        for state in states {
            let key = state.instance.clone();
            let mut instance = Instance {
                file: state.file.clone(),
                ig: object(&key, state.generation, state.spec.clone(), None, None),
                attempts: state.attempts.clone(),
                running: None,
                requeue_at: None,
                invalid: None,
                removal: Removal::No,
                saved: Some(state.clone()),
                unkept: None,
            };
            instance.ig.status = Some(state.status.clone());
            if let Some(newest) = instance.attempts.iter().map(|a| a.spec.sched_rev).max() {
                self.gate.observe(&key, newest);
            }
            self.instances.insert(key, instance);
        }
        let engine = self.engine.clone();
        let pending = match blocking(move || engine.journal().pending_reports()).await {
            Ok(pending) => pending,
            Err(error) => {
                tracing::error!(%error, "the intent journal cannot be read; outcomes it holds are not reported");
                Vec::new()
            }
        };
        for record in pending {
            let key = record.instance.clone();
            let sched_rev = record.attempt.sched_rev;
            if let (Some(instance), Some(outcome)) =
                (self.instances.get_mut(&key), record.outcome.as_ref())
                && let Some(attempt) = instance.attempts.iter_mut().find(|a| {
                    a.spec.sched_rev == sched_rev
                        && a.status.as_ref().and_then(|s| s.outcome).is_none()
                })
            {
                tracing::info!(instance = %key, sched_rev, outcome = ?outcome.outcome, "an outcome from before the restart, kept by the intent journal");
                attempt.status = Some(attempt_status::status_from_outcome_record(outcome));
            }
            self.pending_acks.push((key, sched_rev));
        }
        Ok(())
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

    /// Reads the directory again and brings instances, refusals and status
    /// files in line with it.
    async fn rescan(&mut self) {
        if self.shutting_down {
            return;
        }
        let dir = self.dir.clone();
        let previous = self.files.clone();
        self.files = match blocking(move || manifests::scan(&dir, &previous)).await {
            Ok(files) => files,
            Err(error) => {
                tracing::error!(dir = %self.dir.display(), %error, "the manifest directory cannot be read");
                return;
            }
        };

        // Existing instances keep their file, pass to another file that names
        // them, or go.
        let mut owners: BTreeMap<InstanceKey, String> = BTreeMap::new();
        let mut gone = Vec::new();
        for (key, instance) in &mut self.instances {
            if instance.removal == Removal::No {
                let keeps = match self.files.get(&instance.file).map(|f| &f.parsed) {
                    Some(Parsed::Valid { key: named, .. }) => named == key,
                    Some(Parsed::Invalid(_)) => true,
                    None => false,
                };
                if !keeps {
                    let heir = self
                        .files
                        .iter()
                        .find_map(|(name, file)| match &file.parsed {
                            Parsed::Valid { key: named, .. } if named == key => Some(name.clone()),
                            _ => None,
                        });
                    match heir {
                        Some(heir) => {
                            tracing::info!(instance = %key, from = %instance.file, to = %heir, "another file now defines the instance");
                            instance.file = heir;
                        }
                        None => gone.push(key.clone()),
                    }
                }
            }
            owners.insert(key.clone(), instance.file.clone());
        }

        let now = time_of(SystemTime::now());
        let mut refused: Vec<(String, StatusDocument)> = Vec::new();
        let mut touched: BTreeSet<InstanceKey> = BTreeSet::new();
        for (name, file) in &self.files {
            match &file.parsed {
                Parsed::Invalid(error) => {
                    let owned = self
                        .instances
                        .iter_mut()
                        .find(|(key, i)| i.file == *name && !gone.contains(key));
                    match owned {
                        Some((key, instance)) if instance.removal == Removal::No => {
                            if instance.invalid.as_ref().map(|(e, _)| e) != Some(error) {
                                tracing::warn!(instance = %key, file = %name, %error, "the manifest no longer validates; its last valid spec stays in force");
                                instance.invalid = Some((error.clone(), now.clone()));
                                touched.insert(key.clone());
                            }
                        }
                        _ => {
                            if self.written.get(name).and_then(|d| d.error.as_deref())
                                != Some(error.as_str())
                            {
                                tracing::warn!(file = %name, %error, "manifest refused");
                            }
                            refused.push((
                                name.clone(),
                                status::for_refused(
                                    name,
                                    None,
                                    reasons::INVALID_MANIFEST,
                                    error,
                                    &now,
                                ),
                            ));
                        }
                    }
                }
                Parsed::Valid { key, ig } => match owners.get(key) {
                    Some(owner) if owner == name && !gone.contains(key) => {
                        if let Some(instance) = self.instances.get_mut(key)
                            && instance.removal == Removal::No
                            && apply_manifest(instance, ig)
                        {
                            touched.insert(key.clone());
                        }
                    }
                    Some(owner) => {
                        let stopping = self
                            .instances
                            .get(key)
                            .is_some_and(|i| i.removal != Removal::No)
                            || gone.contains(key);
                        let message = if stopping {
                            format!(
                                "{}/{} is still defined by {owner}, which was deleted; this file takes over once its generations have stopped",
                                key.namespace(),
                                key.name()
                            )
                        } else {
                            format!(
                                "{}/{} is already defined by {owner}; this file is ignored until that file is removed or names another instance",
                                key.namespace(),
                                key.name()
                            )
                        };
                        refused.push((
                            name.clone(),
                            status::for_refused(
                                name,
                                Some(key),
                                reasons::DUPLICATE_NAME,
                                &message,
                                &now,
                            ),
                        ));
                    }
                    None => {
                        tracing::info!(instance = %key, file = %name, "new instance");
                        let instance = Instance {
                            file: name.clone(),
                            ig: object(
                                key,
                                1,
                                ig.spec.clone(),
                                ig.metadata.labels.clone(),
                                ig.metadata.annotations.clone(),
                            ),
                            attempts: Vec::new(),
                            running: None,
                            requeue_at: None,
                            invalid: None,
                            removal: Removal::No,
                            saved: None,
                            unkept: None,
                        };
                        self.instances.insert(key.clone(), instance);
                        owners.insert(key.clone(), name.clone());
                        touched.insert(key.clone());
                    }
                },
            }
        }

        for key in &gone {
            let file = self
                .instances
                .get(key)
                .map(|i| i.file.clone())
                .unwrap_or_default();
            tracing::info!(instance = %key, %file, "the manifest was deleted; stopping the instance");
            self.request_removal(key, &format!("its manifest {file} was deleted"));
        }
        for key in touched {
            self.replan(&key).await;
        }
        for (name, document) in refused {
            self.write_status_document(&name, document).await;
        }
        self.remove_stale_status_files().await;
    }

    /// Plans `key` until the plan is quiet, starts its next attempt, and
    /// writes its state and status.
    async fn replan(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.get_mut(key) else {
            return;
        };
        if instance.removal != Removal::No {
            return;
        }
        let now = time_of(SystemTime::now()).0;
        for _ in 0..MAX_PLANS_PER_CHANGE {
            let plan = scheduler::plan(
                &instance.ig,
                &instance.attempts,
                std::slice::from_ref(&self.node),
                now,
            );
            for event in &plan.events {
                if event.warning {
                    tracing::warn!(instance = %key, reason = %event.reason, "{}", event.message);
                } else {
                    tracing::info!(instance = %key, reason = %event.reason, "{}", event.message);
                }
            }
            instance.ig.status = Some(plan.status);
            let running = instance.running.as_ref().map(|r| r.sched_rev);
            instance.attempts.retain(|attempt| {
                Some(attempt.spec.sched_rev) == running
                    || !plan
                        .delete
                        .iter()
                        .any(|name| attempt.metadata.name.as_deref() == Some(name.as_str()))
            });
            instance.requeue_at = plan.requeue_after.map(|after| Instant::now() + after);
            if plan.create.is_empty() {
                break;
            }
            for attempt in plan.create {
                self.gate.observe(key, attempt.spec.sched_rev);
                instance.attempts.push(attempt);
            }
        }
        // The revisions are reserved durably before anything runs under
        // them (fail closed): unsaved, nothing starts, and the attempts
        // this plan made are dropped (nothing knows their revisions).
        if self.save(key).await {
            self.start_next(key);
        } else if let Some(instance) = self.instances.get_mut(key) {
            let saved: Vec<Option<String>> = instance
                .saved
                .iter()
                .flat_map(|state| state.attempts.iter().map(|a| a.metadata.name.clone()))
                .collect();
            instance
                .attempts
                .retain(|a| a.status.is_some() || saved.contains(&a.metadata.name));
            // Nothing ran or was shown under the revisions this plan issued,
            // so the next plan issues them again rather than skip past them.
            let kept_rev = instance.saved.as_ref().map_or(0, |s| s.status.sched_rev);
            if let Some(status) = instance.ig.status.as_mut() {
                status.sched_rev = kept_rev;
            }
            instance.requeue_at = Some(Instant::now() + STATE_RETRY);
        }
        self.write_status(key).await;
        self.stop_if_unselected(key);
    }

    /// A node outside the manifest's `nodeSelector` runs none of its
    /// instance, as in Kubernetes mode: what serves or runs is stopped, and
    /// the instance starts afresh from its file (a selector that matches
    /// again installs it).
    fn stop_if_unselected(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.get(key) else {
            return;
        };
        let labels = self.node.metadata.labels.as_ref();
        if scheduler::selects(&instance.ig.spec.node_selector, labels)
            || (instance.running.is_none() && self.engine.serving(key).is_none())
        {
            return;
        }
        tracing::info!(instance = %key, "this node no longer matches the nodeSelector; stopping the instance");
        self.request_removal(key, "this node no longer matches its nodeSelector");
    }

    /// Hands the instance's oldest attempt without an outcome to the engine,
    /// unless one already runs. Older ones than the newest are refused by
    /// the gate at admission (superseded) in a moment.
    fn start_next(&mut self, key: &InstanceKey) {
        if self.shutting_down {
            return;
        }
        let Some(instance) = self.instances.get_mut(key) else {
            return;
        };
        if instance.running.is_some() || instance.removal != Removal::No {
            return;
        }
        let Some(next) = instance
            .attempts
            .iter_mut()
            .filter(|a| a.status.as_ref().and_then(|s| s.outcome).is_none())
            .min_by_key(|a| a.spec.sched_rev)
        else {
            return;
        };
        let attempt = Attempt {
            instance: key.clone(),
            name: next.metadata.name.clone().unwrap_or_default(),
            spec: next.spec.clone(),
            restart: None,
        };
        let mut running = attempt_status::status_running(SystemTime::now());
        running.effective_mode = Some(attempt.effective_mode());
        next.status = Some(running);
        let sched_rev = attempt.spec.sched_rev;
        let cancel = Cancel::new();
        instance.running = Some(InFlight {
            sched_rev,
            cancel: cancel.clone(),
        });
        tracing::info!(instance = %key, attempt = %attempt.name, cause = ?attempt.spec.cause, build = %attempt.spec.build.id, "running attempt");
        let engine = self.engine.clone();
        let gate = self.gate.clone();
        let tx = self.tx.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let result = engine.swap(&attempt, gate.as_ref(), &cancel).await;
            let serving = ServingChange::installed(&attempt, &result).map(Box::new);
            let _ = tx.send(Msg::Finished {
                key,
                sched_rev,
                result: Box::new(result),
                serving,
            });
        });
    }

    async fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Finished {
                key,
                sched_rev,
                result,
                serving,
            } => self.finished(key, sched_rev, *result, serving).await,
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
        ));
        self.replan(&change.instance).await;
    }

    /// An attempt ended: its result becomes its status, the status file
    /// says so, then the journal lets go of it and the instance is planned
    /// again.
    async fn finished(
        &mut self,
        key: InstanceKey,
        sched_rev: i64,
        result: SwapResult,
        serving: Option<Box<ServingChange>>,
    ) {
        let Some(instance) = self.instances.get_mut(&key) else {
            self.acknowledge(&key, sched_rev).await;
            return;
        };
        instance.running = None;
        tracing::info!(
            instance = %key,
            sched_rev,
            outcome = ?result.outcome,
            mode = ?result.effective_mode,
            executed = result.executed,
            drain_ms = ?result.drain_ms(),
            reason = %result.reason,
            "attempt ended"
        );
        if let Some(attempt) = instance
            .attempts
            .iter_mut()
            .find(|a| a.spec.sched_rev == sched_rev)
        {
            let mut status = attempt_status::status_from_result(&result);
            status.serving =
                serving.map(|change| attempt_status::serving_status(&change.supervised, None));
            attempt.status = Some(status);
        }
        match instance.removal {
            Removal::No => {
                self.replan(&key).await;
                if self.instances.get(&key).is_some_and(|i| i.is_saved(&key)) {
                    self.acknowledge(&key, sched_rev).await;
                } else if !self.journal_keeps(&key, sched_rev).await {
                    // Kept nowhere: a restart would not know it, so it is
                    // not shown either. The attempt stands as not run and
                    // runs again once its revision is on disk.
                    if let Some(attempt) = self.instances.get_mut(&key).and_then(|i| {
                        i.attempts
                            .iter_mut()
                            .find(|a| a.spec.sched_rev == sched_rev)
                    }) {
                        attempt.status = None;
                    }
                    self.replan(&key).await;
                }
            }
            Removal::Requested | Removal::Stopping => {
                // The instance goes away: its outcome has no reader left.
                self.acknowledge(&key, sched_rev).await;
                self.begin_stop(&key);
            }
        }
    }

    /// Whether the journal holds the outcome of `sched_rev` for a restart
    /// to deliver.
    async fn journal_keeps(&self, key: &InstanceKey, sched_rev: i64) -> bool {
        let engine = self.engine.clone();
        let owned = key.clone();
        blocking(move || engine.journal().load_entry(&owned))
            .await
            .ok()
            .flatten()
            .is_some_and(|entry| {
                entry
                    .pending_reports()
                    .iter()
                    .any(|r| r.attempt.sched_rev == sched_rev)
            })
    }

    /// Drops the journal's copy of an outcome the status file now holds.
    async fn acknowledge(&self, key: &InstanceKey, sched_rev: i64) {
        let engine = self.engine.clone();
        let owned = key.clone();
        if let Err(error) = blocking(move || engine.journal().acknowledge(&owned, sched_rev)).await
        {
            tracing::warn!(instance = %key, sched_rev, %error, "the intent journal could not drop a reported outcome; it is reported again after a restart");
        }
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

    async fn requeue_due(&mut self) {
        let now = Instant::now();
        let due: Vec<InstanceKey> = self
            .instances
            .iter()
            .filter(|(_, i)| i.requeue_at.is_some_and(|at| at <= now))
            .map(|(key, _)| key.clone())
            .collect();
        for key in due {
            let Some(instance) = self.instances.get_mut(&key) else {
                continue;
            };
            instance.requeue_at = None;
            match instance.removal {
                Removal::Requested if instance.running.is_none() => self.begin_stop(&key),
                Removal::No => self.replan(&key).await,
                _ => {}
            }
        }
    }

    /// Writes the instance's state unless it is unchanged; `true` when
    /// what is in memory is on disk.
    async fn save(&mut self, key: &InstanceKey) -> bool {
        let Some(instance) = self.instances.get_mut(key) else {
            return false;
        };
        let state = instance.state(key);
        if instance.saved.as_ref() == Some(&state) {
            return true;
        }
        let store = self.store.clone();
        let to_write = state.clone();
        match blocking(move || store.save(&to_write)).await {
            Ok(()) => {
                instance.saved = Some(state);
                instance.unkept = None;
                true
            }
            Err(error) => {
                tracing::error!(instance = %key, %error, "the standalone state could not be written; nothing starts until it can");
                if instance.unkept.is_none() {
                    instance.unkept = Some((
                        format!(
                            "the standalone state cannot be written ({error}); no attempt starts until it can"
                        ),
                        time_of(SystemTime::now()),
                    ));
                }
                false
            }
        }
    }

    async fn write_status(&mut self, key: &InstanceKey) {
        let Some(instance) = self.instances.get(key) else {
            return;
        };
        let document = status::for_instance(
            &instance.file,
            key,
            instance.generation(),
            &instance.ig.status.clone().unwrap_or_default(),
            &instance.attempts,
            instance
                .invalid
                .as_ref()
                .map(|(error, since)| (error.as_str(), since)),
        );
        let mut document = document;
        if let Some((error, since)) = &instance.unkept {
            set_condition(
                &mut document.status.conditions,
                ConditionType::Stalled,
                true,
                STATE_UNWRITABLE,
                error,
                Some(instance.generation()),
                since,
            );
            document.error.get_or_insert_with(|| error.clone());
        }
        let file = instance.file.clone();
        self.write_status_document(&file, document).await;
    }

    async fn write_status_document(&mut self, file: &str, document: StatusDocument) {
        if self.written.get(file) == Some(&document) {
            return;
        }
        // A refusal that still holds keeps the status (and the time) it has.
        if document.generation.is_none()
            && self.written.get(file).is_some_and(|written| {
                written.generation.is_none()
                    && written.error == document.error
                    && (&written.namespace, &written.name) == (&document.namespace, &document.name)
            })
        {
            return;
        }
        let text = match status::render(&document) {
            Ok(text) => text,
            Err(error) => {
                tracing::error!(%file, %error, "a status file could not be encoded");
                return;
            }
        };
        let path = self.status_dir.join(file);
        match blocking(move || replace_file(&path, text.as_bytes(), 0o644)).await {
            Ok(()) => {
                self.written.insert(file.to_string(), document);
            }
            Err(error) => tracing::error!(%file, %error, "a status file could not be written"),
        }
    }

    async fn remove_status_file(&mut self, file: &str) {
        self.written.remove(file);
        let path = self.status_dir.join(file);
        if let Err(error) = blocking(move || remove_if_exists(&path)).await {
            tracing::warn!(%file, %error, "a status file could not be removed");
        }
    }

    /// Removes status files whose manifest is gone (deleted while standalone
    /// mode was not running, or a refused file deleted), keeping those of
    /// instances still being stopped.
    async fn remove_stale_status_files(&mut self) {
        let dir = self.status_dir.clone();
        let on_disk: Vec<String> = blocking(move || {
            fs::read_dir(&dir)
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .filter_map(|e| e.file_name().to_str().map(str::to_string))
                        .filter(|name| manifests::is_manifest_name(name))
                        .collect()
                })
                .unwrap_or_default()
        })
        .await;
        let in_use: BTreeSet<&String> = self
            .files
            .keys()
            .chain(self.instances.values().map(|i| &i.file))
            .collect();
        let stale: Vec<String> = on_disk
            .into_iter()
            .chain(self.written.keys().cloned())
            .filter(|name| !in_use.contains(name))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        for name in stale {
            self.remove_status_file(&name).await;
        }
    }
}

/// Copies a valid manifest into the instance: a changed spec is a new
/// generation. Returns whether anything the scheduler reads changed.
fn apply_manifest(instance: &mut Instance, ig: &InstanceGeneration) -> bool {
    let was_invalid = instance.invalid.take().is_some();
    instance.ig.metadata.labels = ig.metadata.labels.clone();
    instance.ig.metadata.annotations = ig.metadata.annotations.clone();
    if instance.ig.spec == ig.spec {
        return was_invalid;
    }
    instance.ig.spec = ig.spec.clone();
    instance.ig.metadata.generation = Some(instance.generation() + 1);
    true
}

/// The InstanceGeneration the scheduler plans: the manifest's spec with the
/// generation standalone mode keeps, no uid (so attempts carry no owner
/// reference), in the instance's namespace.
fn object(
    key: &InstanceKey,
    generation: i64,
    spec: genswap_crds::InstanceGenerationSpec,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
) -> InstanceGeneration {
    let mut ig = InstanceGeneration::new(key.name(), spec);
    ig.metadata = ObjectMeta {
        name: Some(key.name().to_string()),
        namespace: Some(key.namespace().to_string()),
        generation: Some(generation),
        labels,
        annotations,
        ..ObjectMeta::default()
    };
    ig
}

/// Sleeps until `due`, or forever without one (the select arm is disabled
/// then).
async fn sleep_until(due: Option<Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due).await,
        None => std::future::pending().await,
    }
}
