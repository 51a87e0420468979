//! Supervision between attempts (SPEC 5.10): a serving generation's exit is
//! noticed at once, handled, and followed by what `restartPolicy` says.
//!
//! Each generation the engine holds as serving while no attempt runs is
//! watched by a task awaiting a pidfd of its main process (registered with
//! tokio: no polling loop). When it becomes readable the process has
//! exited, and the supervisor handles it: it reaps the process (no zombie
//! of the agent), reads whether the kernel OOM-killed anything in its
//! cgroup, stops whatever the generation left running there with proof of
//! exit, removes its cgroup, socket and `current.sock`, and journals that
//! nothing serves and how the generation ended. An exit during an attempt is
//! the attempt's to meet; the watch is set again when the attempt hands the
//! generation back, and fires at once if it is already gone.
//!
//! # Restarts
//!
//! The journal keeps, per instance, the lineage the last `done` installed
//! ([`Supervised`]): that attempt's spec, the restarts since, the state.
//! After an exit the policy decides. A restart is an attempt of that spec
//! run through the same flow as any other (journal, crash points, health,
//! `current.sock` moved when healthy) with a fresh generation N+1; it is
//! marked as the k-th restart, so it is never reported as the API
//! attempt's outcome, and no newer API attempt supersedes it (see
//! [`AttemptGate::check_restart`]). The first restart after an exit is at
//! once, each further one in a row waits [`RestartBackoff::delay`]; a
//! generation that stayed up [`RestartBackoff::reset_after`] resets the
//! count. A failed restart counts as another exit.
//!
//! The supervisor reconciles each instance from the journal whenever it
//! is idle (at start, after every attempt and exit): nothing serves, a
//! lineage exists and its policy restarts → a restart is due. So a
//! generation that died while the agent was away, a restart interrupted by
//! a crash, and an API attempt that failed over a dead incumbent are all
//! met the same way. Every change of a lineage's state is handed to the
//! adapter as a [`ServingChange`], which it writes as the `serving` block
//! of the attempt that installed it.

use std::collections::HashSet;
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use genswap_crds::{Outcome, RestartPolicy, ServingState};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::liveness::LivenessFailure;
use super::{Attempt, Cancel, Engine, Running, SwapResult, parts};
use crate::gate::{AttemptGate, InstanceKey};
use crate::journal::{AttemptRef, ExitRecord, InstanceEntry, Supervised, unix_millis_now};

/// How restarts of an exited generation back off (the kubelet's figures by
/// default: at once, then 10 s doubling to 5 minutes, reset after 10
/// minutes up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartBackoff {
    /// The wait before the second restart in a row.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
    /// A generation up this long starts the count again.
    pub reset_after: Duration,
}

impl Default for RestartBackoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(300),
            reset_after: Duration::from_secs(600),
        }
    }
}

impl RestartBackoff {
    /// The wait before the restart that follows the `exits_in_a_row`-th
    /// exit in a row: none after the first, then `initial` doubling up to
    /// `max`.
    pub fn delay(&self, exits_in_a_row: u32) -> Duration {
        if exits_in_a_row <= 1 {
            return Duration::ZERO;
        }
        let doublings = (exits_in_a_row - 2).min(31);
        self.initial
            .checked_mul(1 << doublings)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

/// What the supervisor tells its adapter.
#[derive(Clone, Debug, PartialEq)]
pub enum SupervisorEvent {
    /// A serving generation exited between attempts (already reaped, cleaned
    /// up and journaled).
    Exited(GenerationExit),
    /// A restart serves: `generation` answers through `current.sock`.
    Restarted {
        instance: InstanceKey,
        generation: u64,
        /// The lineage's restarts so far.
        restarts: u32,
        /// The reason label of the exit that caused it.
        after: &'static str,
        /// The restart's steps, as an attempt's (its health step is the
        /// new generation's boot: from its exec to its first healthy answer).
        steps: Vec<super::StepRecord>,
    },
    /// A lineage's state as journaled now: what the adapter writes as the
    /// `serving` block of the attempt that installed it.
    Serving(Box<ServingChange>),
}

/// A lineage's state after a change.
#[derive(Clone, Debug, PartialEq)]
pub struct ServingChange {
    pub instance: InstanceKey,
    pub supervised: Supervised,
    /// How its last generation that exited ended, if one did.
    pub last_exit: Option<ExitRecord>,
    /// The serving generation's sidecars (SPEC 5.13).
    pub sidecars: Vec<genswap_crds::SidecarStatus>,
}

impl ServingChange {
    /// The attempt whose status carries the block.
    pub fn attempt(&self) -> &AttemptRef {
        &self.supervised.attempt
    }

    /// The block a `done` attempt that holds listeners or runs sidecars
    /// starts its lineage with, so its status says what the agent holds and
    /// runs from the start; `None` for any other end, and for a lineage
    /// with nothing to show until it exits (a done attempt without a block
    /// reads as running). `sidecars` is what [`Engine::sidecars`] says now.
    pub fn installed(
        attempt: &Attempt,
        result: &SwapResult,
        sidecars: Vec<genswap_crds::SidecarStatus>,
    ) -> Option<ServingChange> {
        let generation = result.generation?;
        let shown = result.outcome == Outcome::Done
            && attempt.restart.is_none()
            && (!attempt.spec.listeners.is_empty() || !attempt.spec.sidecars.is_empty());
        shown.then(|| ServingChange {
            instance: attempt.instance.clone(),
            supervised: Supervised::new(
                AttemptRef {
                    name: attempt.name.clone(),
                    uid: None,
                    sched_rev: attempt.spec.sched_rev,
                },
                attempt.spec.clone(),
                generation,
            ),
            last_exit: None,
            sidecars,
        })
    }
}

/// Logs an event the way both intakes do.
pub fn log_event(event: &SupervisorEvent) {
    match event {
        SupervisorEvent::Exited(exit) => tracing::warn!(
            instance = %exit.instance,
            generation = exit.exit.generation,
            build = %exit.exit.build,
            exit = %exit.describe(),
            "a serving generation exited between attempts; nothing serves the instance now"
        ),
        SupervisorEvent::Restarted {
            instance,
            generation,
            restarts,
            ..
        } => tracing::info!(
            instance = %instance,
            generation,
            restarts,
            "restarted: the new generation is healthy and serves"
        ),
        SupervisorEvent::Serving(change) => match change.supervised.state {
            ServingState::Running => {}
            _ => tracing::warn!(
                instance = %change.instance,
                state = ?change.supervised.state,
                message = change.supervised.message.as_deref().unwrap_or_default(),
                "the instance is down between attempts"
            ),
        },
    }
}

/// A serving generation that exited between attempts, as handled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerationExit {
    pub instance: InstanceKey,
    pub exit: ExitRecord,
}

impl GenerationExit {
    /// `exit code 0`, `signal 9 (SIGKILL), OOM-killed`.
    pub fn describe(&self) -> String {
        describe(&self.exit)
    }

    /// A metric label: `oom_killed`, `signaled`, `exited`, `unknown`.
    pub fn reason(&self) -> &'static str {
        reason_label(&self.exit)
    }
}

fn describe(exit: &ExitRecord) -> String {
    let how = genswap_crds::describe_exit(exit.exit_code, exit.signal, exit.oom_killed);
    match &exit.liveness_failed {
        Some(failure) => format!("{how} after its {failure}"),
        None => how,
    }
}

fn reason_label(exit: &ExitRecord) -> &'static str {
    if exit.liveness_failed.is_some() {
        return "liveness_failed";
    }
    match (exit.oom_killed, exit.exit_code, exit.signal) {
        (true, _, _) => "oom_killed",
        (false, _, Some(_)) => "signaled",
        (false, Some(_), None) => "exited",
        (false, None, None) => "unknown",
    }
}

/// What the watch tasks and the engine tell the supervisor.
#[derive(Debug)]
pub(super) enum Notice {
    /// The main process of this generation exited.
    Exited(InstanceKey, u64),
    /// This generation failed its liveness probe `failureThreshold` times
    /// in a row; it still runs.
    LivenessFailed(InstanceKey, u64, LivenessFailure),
    /// An attempt (or a stop) of the instance ended with nothing serving.
    Idle(InstanceKey),
    /// A sidecar of this generation changed its state.
    Sidecars(InstanceKey, u64),
}

/// Where the watch tasks and the engine leave their notices.
#[derive(Debug)]
pub(super) struct Notices {
    sender: mpsc::UnboundedSender<Notice>,
    receiver: Mutex<Option<mpsc::UnboundedReceiver<Notice>>>,
}

impl Notices {
    pub(super) fn new() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Self {
            sender,
            receiver: Mutex::new(Some(receiver)),
        }
    }

    /// Starts the watch of `running`'s main process, and of its liveness
    /// probe when it has one. The watch ends with the first of the two.
    pub(super) fn watch(&self, instance: &InstanceKey, running: &Running) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (sender, instance) = (self.sender.clone(), instance.clone());
        let (generation, pid) = (running.record.n, running.process.pid());
        runtime.spawn(async move {
            if crate::process::pid_exited(pid).await {
                let _ = sender.send(Notice::Exited(instance, generation));
            }
        });
    }

    /// Starts `running`'s liveness probing, unless it has none or it runs.
    /// It lasts as long as `running` (stopping the generation ends it
    /// first); a failure met while an attempt holds the generation is not
    /// acted on, and probing goes on.
    pub(super) fn probe_liveness(&self, instance: &InstanceKey, running: &mut Running) {
        let Some(liveness) = running.liveness.clone() else {
            return;
        };
        if running.liveness_task.is_some() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (sender, instance) = (self.sender.clone(), instance.clone());
        let generation = running.record.n;
        let task = runtime.spawn(async move {
            loop {
                let failure = liveness.failed().await;
                let notice = Notice::LivenessFailed(instance.clone(), generation, failure);
                if sender.send(notice).is_err() {
                    return;
                }
            }
        });
        running.liveness_task = Some(super::liveness::AbortOnDrop(task));
    }

    /// Where notices are sent, for a task of the engine's own.
    pub(super) fn sender(&self) -> mpsc::UnboundedSender<Notice> {
        self.sender.clone()
    }

    /// Says that `instance` is idle with nothing serving.
    pub(super) fn idle(&self, instance: &InstanceKey) {
        let _ = self.sender.send(Notice::Idle(instance.clone()));
    }
}

/// The supervisor's task; dropping it stops the supervisor and any restart
/// it runs (what a restart had started is left to the next start's
/// recovery, like any interrupted attempt).
#[derive(Debug)]
pub struct Supervisor(tokio::task::JoinHandle<()>);

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What ended in the supervisor's task set.
enum TaskEnd {
    /// A restart's wait is over.
    Due(InstanceKey),
    /// A restart ran.
    Restarted(InstanceKey, Box<SwapResult>),
}

/// The supervisor loop's own state: which instances have a restart
/// waiting or running.
struct Loop {
    engine: Arc<Engine>,
    gate: Arc<dyn AttemptGate>,
    on_event: Box<dyn Fn(SupervisorEvent) + Send + Sync>,
    pending: HashSet<InstanceKey>,
    tasks: JoinSet<TaskEnd>,
}

impl Engine {
    /// Runs the supervisor as a task for as long as the returned guard
    /// lives: what an intake keeps while it runs. `gate` admits restarts
    /// (through [`AttemptGate::check_restart`]); `on_event` is told every
    /// exit, restart and state change. A second supervisor of the same
    /// engine does nothing.
    pub fn start_supervisor(
        self: &Arc<Self>,
        gate: Arc<dyn AttemptGate>,
        on_event: impl Fn(SupervisorEvent) + Send + Sync + 'static,
    ) -> Supervisor {
        let receiver = self
            .notices
            .receiver
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let mut state = Loop {
            engine: Arc::clone(self),
            gate,
            on_event: Box::new(on_event),
            pending: HashSet::new(),
            tasks: JoinSet::new(),
        };
        Supervisor(tokio::spawn(async move {
            if let Some(receiver) = receiver {
                state.run(receiver).await;
            }
        }))
    }

    /// Meets the end of a serving generation between attempts: its exit,
    /// or its liveness `failure` (it still runs, and is stopped here with
    /// proof). Either way its cgroup and socket go and the end is journaled.
    async fn handle_exit(
        &self,
        instance: &InstanceKey,
        generation: u64,
        failure: Option<LivenessFailure>,
    ) -> Option<GenerationExit> {
        self.forget_watch(instance, generation);
        // A retired generation's watch, or an attempt running (which meets
        // the exit itself, and watches again after): nothing to claim.
        let serves = self.lock_instances().get(instance).is_some_and(|state| {
            !state.busy
                && state
                    .serving
                    .as_ref()
                    .is_some_and(|running| running.record.n == generation)
        });
        if !serves {
            return None;
        }
        let mut claim = self.claim(instance)?;
        if claim
            .serving
            .as_ref()
            .is_none_or(|running| running.record.n != generation)
        {
            return None;
        }
        let mut running = claim.serving.take()?;
        let status = parts::has_exited(&mut running);
        let mut exit = ExitRecord {
            generation,
            build: running.record.build.clone(),
            exit_code: status.and_then(|s| s.code()),
            signal: status.and_then(|s| s.signal()),
            oom_killed: running.cgroup.oom_killed(),
            at_ms: unix_millis_now(),
            serving_since_ms: running.record.serving_since_ms,
            liveness_failed: failure.as_ref().map(LivenessFailure::describe),
        };
        let stop = running.record.stop.clone().unwrap_or_default();
        let stopped = parts::stop_generation(running, &stop).await;
        if let (Some(_), Ok(report)) = (&failure, &stopped) {
            // Stopped by the agent: by the stop signal, or killed after it.
            let signal = if report.killed {
                nix::sys::signal::Signal::SIGKILL
            } else {
                crate::cgroup::stop_signal(stop.signal)
            };
            exit.signal = exit.signal.or(Some(signal as i32));
            exit.oom_killed = false;
        }
        if let Err((running, error)) = stopped {
            tracing::error!(
                instance = %instance,
                generation,
                error = %super::flow::reason_of(&error),
                "what an exited generation left in its cgroup could not be proven stopped"
            );
            claim.serving = Some(running);
            return None;
        }
        parts::remove_current_link(&self.layout, instance);
        let journal = Arc::clone(&self.journal);
        let (key, record) = (instance.clone(), exit.clone());
        if let Err(error) = parts::blocking(move || journal.record_exit(&key, record)).await {
            tracing::error!(instance = %instance, error = %super::flow::reason_of(&error), "the exit could not be journaled; recovery finds it");
        }
        Some(GenerationExit {
            instance: instance.clone(),
            exit,
        })
    }

    fn is_busy(&self, instance: &InstanceKey) -> bool {
        self.lock_instances()
            .get(instance)
            .is_some_and(|state| state.busy)
    }
}

impl Loop {
    async fn run(&mut self, mut receiver: mpsc::UnboundedReceiver<Notice>) {
        let journal = Arc::clone(&self.engine.journal);
        match parts::blocking(move || journal.load_all()).await {
            Ok((entries, _corrupt)) => {
                for entry in entries.into_iter().filter(|e| e.supervised.is_some()) {
                    self.tell_state(&entry);
                    if self.idle(&entry.instance) {
                        self.reconcile_entry(entry).await;
                    }
                }
            }
            Err(error) => tracing::error!(
                error = %super::flow::reason_of(&error),
                "the journal cannot be read: instances that exited while the agent was away are not restarted"
            ),
        }
        loop {
            tokio::select! {
                notice = receiver.recv() => match notice {
                    Some(Notice::Exited(instance, generation)) => {
                        if let Some(exit) = self.engine.handle_exit(&instance, generation, None).await {
                            (self.on_event)(SupervisorEvent::Exited(exit));
                            self.reconcile(&instance).await;
                        }
                    }
                    Some(Notice::LivenessFailed(instance, generation, failure)) => {
                        tracing::warn!(instance = %instance, generation, reason = %failure.describe(), "the serving generation failed its liveness probe; stopping it");
                        if let Some(exit) = self.engine.handle_exit(&instance, generation, Some(failure)).await {
                            (self.on_event)(SupervisorEvent::Exited(exit));
                            self.reconcile(&instance).await;
                        }
                    }
                    Some(Notice::Idle(instance)) => self.reconcile(&instance).await,
                    Some(Notice::Sidecars(instance, generation)) => {
                        // Only the lineage's own generation: an overlap's
                        // successor is told with its attempt's outcome.
                        if let Some(entry) = self.load(&instance).await
                            && entry.supervised.as_ref().is_some_and(|s| s.generation == generation)
                        {
                            self.tell_state(&entry);
                        }
                    }
                    None => return,
                },
                Some(ended) = self.tasks.join_next(), if !self.tasks.is_empty() => match ended {
                    Ok(TaskEnd::Due(instance)) => {
                        self.pending.remove(&instance);
                        self.restart(&instance).await;
                    }
                    Ok(TaskEnd::Restarted(instance, result)) => {
                        self.pending.remove(&instance);
                        self.after_restart(&instance, &result).await;
                    }
                    Err(error) => {
                        tracing::error!(%error, "a restart task failed");
                    }
                },
            }
        }
    }

    /// Tells the adapter a lineage's state as journaled.
    fn tell_state(&self, entry: &InstanceEntry) {
        if let Some(supervised) = &entry.supervised {
            (self.on_event)(SupervisorEvent::Serving(Box::new(ServingChange {
                instance: entry.instance.clone(),
                supervised: supervised.clone(),
                last_exit: entry.last_exit.clone(),
                sidecars: self.engine.sidecars(&entry.instance),
            })));
        }
    }

    async fn load(&self, instance: &InstanceKey) -> Option<InstanceEntry> {
        let journal = Arc::clone(&self.engine.journal);
        let key = instance.clone();
        match parts::blocking(move || journal.load_entry(&key)).await {
            Ok(entry) => entry,
            Err(error) => {
                tracing::error!(instance = %instance, error = %super::flow::reason_of(&error), "the journal cannot be read; the instance is not supervised until it can");
                None
            }
        }
    }

    async fn write(
        &self,
        instance: &InstanceKey,
        change: impl FnOnce(&mut Supervised) + Send + 'static,
    ) {
        let journal = Arc::clone(&self.engine.journal);
        let key = instance.clone();
        match parts::blocking(move || journal.update_supervised(&key, change)).await {
            Ok(Some(entry)) => self.tell_state(&entry),
            Ok(None) => {}
            Err(error) => {
                tracing::error!(instance = %instance, error = %super::flow::reason_of(&error), "the supervisor's state could not be journaled")
            }
        }
    }

    /// Brings an idle instance in line with its policy: schedules the
    /// restart an exit calls for, or records that none follows.
    async fn reconcile(&mut self, instance: &InstanceKey) {
        if !self.idle(instance) {
            return;
        }
        if let Some(entry) = self.load(instance).await {
            self.reconcile_entry(entry).await;
        }
    }

    /// No restart waits or runs, no attempt holds it, nothing serves it.
    fn idle(&self, instance: &InstanceKey) -> bool {
        !self.pending.contains(instance)
            && !self.engine.is_busy(instance)
            && self.engine.serving(instance).is_none()
    }

    /// [`reconcile`](Self::reconcile) of an idle instance, from its journal
    /// entry as just read.
    async fn reconcile_entry(&mut self, entry: InstanceEntry) {
        let instance = &entry.instance;
        let Some(supervised) = entry.supervised.clone() else {
            return;
        };
        if entry.serving.is_some() || entry.attempt.as_ref().is_some_and(|r| r.outcome.is_none()) {
            return;
        }
        let policy = RestartPolicy::effective(supervised.spec.restart_policy, supervised.spec.kind);
        let exit = entry.last_exit.clone();
        let clean = exit.as_ref().is_some_and(ExitRecord::clean);
        let now = unix_millis_now();
        if supervised.state == ServingState::Running {
            // An exit the policy has not met yet.
            let backoff = self.engine.config.restart_backoff;
            let stayed_up = exit.as_ref().and_then(|e| {
                e.serving_since_ms
                    .map(|since| Duration::from_millis(u64::try_from(e.at_ms - since).unwrap_or(0)))
            });
            let in_a_row = if stayed_up.is_some_and(|up| up >= backoff.reset_after) {
                1
            } else {
                supervised.consecutive_exits.saturating_add(1)
            };
            let generation = exit
                .as_ref()
                .map_or(supervised.generation, |e| e.generation);
            let how = exit
                .as_ref()
                .map_or_else(|| "an end this agent did not see".to_string(), describe);
            if !policy.restarts_after(clean) {
                let message = format!(
                    "generation {generation} exited with {how}; restartPolicy {} does not restart it",
                    policy.as_str()
                );
                self.write(instance, move |s| {
                    s.state = ServingState::Exited;
                    s.generation = generation;
                    s.consecutive_exits = in_a_row;
                    s.restart_at_ms = None;
                    s.message = Some(message);
                })
                .await;
                return;
            }
            if !self.engine.config.swaps_on {
                let message = format!(
                    "generation {generation} exited with {how}; swaps are off on this node (--swap=off), so it is not restarted"
                );
                self.write(instance, move |s| {
                    s.state = ServingState::Exited;
                    s.generation = generation;
                    s.message = Some(message);
                })
                .await;
                return;
            }
            let delay = backoff.delay(in_a_row);
            let restart_at = due_in(now, delay);
            let message = if delay.is_zero() {
                format!("generation {generation} exited with {how}; restarting it")
            } else {
                format!(
                    "generation {generation} exited with {how}, {in_a_row} exits in a row; restarting it in {}s",
                    delay.as_secs()
                )
            };
            self.write(instance, move |s| {
                s.state = if delay.is_zero() {
                    ServingState::Exited
                } else {
                    ServingState::BackOff
                };
                s.generation = generation;
                s.consecutive_exits = in_a_row;
                s.restart_at_ms = Some(restart_at);
                s.message = Some(message);
            })
            .await;
            if delay.is_zero() {
                // Not through the timer: its tick would add up to a
                // millisecond to every first restart.
                self.restart(instance).await;
            } else {
                self.schedule(instance, delay);
            }
            return;
        }
        // Exited or backing off: a restart is owed unless the policy left it
        // down, or swaps are off.
        let owed = supervised.restart_at_ms.is_some() && policy.restarts_after(clean);
        if owed && self.engine.config.swaps_on {
            let due = supervised.restart_at_ms.unwrap_or(now);
            self.schedule(
                instance,
                Duration::from_millis(u64::try_from(due - now).unwrap_or(0)),
            );
        }
    }

    fn schedule(&mut self, instance: &InstanceKey, delay: Duration) {
        let key = instance.clone();
        self.tasks.spawn(async move {
            tokio::time::sleep(delay).await;
            TaskEnd::Due(key)
        });
        self.pending.insert(instance.clone());
    }

    /// Starts the restart that is due, unless an attempt got there first.
    async fn restart(&mut self, instance: &InstanceKey) {
        if self.engine.is_busy(instance) || self.engine.serving(instance).is_some() {
            // The attempt's end says Idle again when nothing serves then.
            return;
        }
        let Some(entry) = self.load(instance).await else {
            return;
        };
        let Some(supervised) = entry.supervised else {
            return;
        };
        if entry.serving.is_some() || supervised.restart_at_ms.is_none() {
            return;
        }
        let mut spec = supervised.spec.clone();
        // A restart brings back what served; it is nobody's canary.
        spec.canary = false;
        spec.settle.all_nodes = false;
        let attempt = Attempt {
            instance: instance.clone(),
            name: supervised.attempt.name.clone(),
            spec,
            restart: Some(supervised.restarts.saturating_add(1)),
        };
        let (engine, gate, key) = (
            Arc::clone(&self.engine),
            Arc::clone(&self.gate),
            instance.clone(),
        );
        tracing::info!(
            instance = %instance,
            restart = supervised.restarts.saturating_add(1),
            build = %attempt.spec.build.id,
            "restarting an exited generation"
        );
        self.tasks.spawn(async move {
            let cancel = Cancel::new();
            let result = engine.swap(&attempt, &*gate, &cancel).await;
            TaskEnd::Restarted(key, Box::new(result))
        });
        self.pending.insert(instance.clone());
    }

    async fn after_restart(&mut self, instance: &InstanceKey, result: &SwapResult) {
        let Some(entry) = self.load(instance).await else {
            return;
        };
        let Some(supervised) = entry.supervised.clone() else {
            return;
        };
        if result.outcome == Outcome::Done && entry.serving.is_some() {
            (self.on_event)(SupervisorEvent::Restarted {
                instance: instance.clone(),
                generation: supervised.generation,
                restarts: supervised.restarts,
                after: entry.last_exit.as_ref().map_or("unknown", reason_label),
                steps: result.steps.clone(),
            });
            self.tell_state(&entry);
            return;
        }
        if entry.serving.is_some() || self.engine.serving(instance).is_some() {
            return;
        }
        if result.outcome == Outcome::Done && result.clean_exit {
            // A worker's restart did its job inside its window.
            let message = format!(
                "restart {} exited 0 inside its settle window: its job is done",
                supervised.restarts.saturating_add(1)
            );
            self.write(instance, move |s| {
                s.state = ServingState::Exited;
                s.restart_at_ms = None;
                s.message = Some(message);
            })
            .await;
            return;
        }
        // Another exit in a row: back off before the next try.
        let in_a_row = supervised.consecutive_exits.saturating_add(1);
        let delay = self.engine.config.restart_backoff.delay(in_a_row);
        let restart_at = due_in(unix_millis_now(), delay);
        let message = format!(
            "restart {} failed ({}); trying again in {}s",
            supervised.restarts.saturating_add(1),
            result.reason,
            delay.as_secs()
        );
        tracing::warn!(instance = %instance, outcome = ?result.outcome, reason = %result.reason, "a restart did not serve");
        self.write(instance, move |s| {
            s.state = ServingState::BackOff;
            s.consecutive_exits = in_a_row;
            s.restart_at_ms = Some(restart_at);
            s.message = Some(message);
        })
        .await;
        self.schedule(instance, delay);
    }
}

/// Unix millis `delay` after `now`.
fn due_in(now: i64, delay: Duration) -> i64 {
    now.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_restart_is_at_once_then_the_wait_doubles_to_the_cap() {
        let backoff = RestartBackoff::default();
        let waits: Vec<u64> = (1..=8).map(|n| backoff.delay(n).as_secs()).collect();
        assert_eq!(waits, [0, 10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(backoff.delay(u32::MAX), backoff.max);
    }
}
