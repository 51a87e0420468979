//! The agent's event loop: the watch, the node lock, the intake, one task per
//! running attempt, one per build staged ahead, one per outcome being
//! written, and shutdown.
//!
//! All decisions are made on the loop by [`Intake`]; tasks only do I/O and
//! tell the loop when an attempt has ended.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;
use genswap_crds::{Outcome, ServingState, ServingStatus, SwapAttempt, SwapAttemptStatus};
use genswap_runtime::watch_backoff::reconnecting;
use kube::Client;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::inbox::{InboxSource, attempts_from_inbox};
use super::intake::{Decision, Intake};
use super::report::{OutcomeReport, ReportTarget, Reporter, ServingTarget, error_chain};
use super::retire::{self, Owner};
use super::{KubeAgentConfig, KubeAgentError};
use crate::attempt_status::serving_status;
use crate::engine::{
    Attempt, Cancel, Engine, EngineError, ServingChange, Supervisor, SupervisorEvent,
    effective_mode,
};
use crate::gate::{InstanceKey, NewestRevisionGate};
use crate::journal::unix_millis_now;
use crate::metrics::{AgentMetrics, Readiness, Retirement};
use crate::ownership::NodeLock;

/// Kubernetes mode over a given client: what [`super::run`] runs, and what
/// tests run against a mocked API server.
pub struct KubeAgent {
    client: Client,
    engine: Arc<Engine>,
    gate: Arc<NewestRevisionGate>,
    config: KubeAgentConfig,
    metrics: Arc<AgentMetrics>,
    readiness: Readiness,
}

/// Whether an attempt's `serving` block already says `wanted`: equal, or
/// absent where a fresh lineage runs (a `done` attempt without a block is
/// read as running), unless the block has listeners to show.
fn already_says(current: Option<&ServingStatus>, wanted: &ServingStatus) -> bool {
    match current {
        Some(current) => current == wanted,
        None => {
            wanted.state == ServingState::Running
                && wanted.restarts == 0
                && wanted.last_exit.is_none()
                && wanted.listeners.is_empty()
        }
    }
}

/// A running attempt ended; sent by its task, also when the task panics.
struct Ended {
    instance: InstanceKey,
    sched_rev: i64,
    /// The outcome to write; `None` when nothing was decided (it was found
    /// finished or deleted, or shutdown came before it ran).
    report: Option<OutcomeReport>,
    /// The `serving` block a done attempt starts with, when it has one to
    /// show ([`ServingChange::installed`]).
    serving: Option<ServingChange>,
}

/// What an attempt's task shares with the loop.
struct Shared {
    client: Client,
    engine: Arc<Engine>,
    gate: Arc<NewestRevisionGate>,
    reporter: Reporter,
    metrics: Arc<AgentMetrics>,
    config: KubeAgentConfig,
    ended: mpsc::UnboundedSender<Ended>,
    /// One build staged ahead at a time: a rollout's pre-staging must not
    /// take the node's bandwidth from the swaps it serves.
    stage_slot: Arc<tokio::sync::Semaphore>,
}

/// A stage-only attempt this agent took.
enum Ask {
    Staging(tokio::task::AbortHandle),
    /// Its outcome is being written: a later event of it (a progress write
    /// the watch delivers late) does not stage it again.
    Finished,
}

/// What a stage-only attempt's task hands the loop.
struct StagedAhead {
    attempt: Arc<SwapAttempt>,
    status: SwapAttemptStatus,
}

/// A running attempt's revision and its lifetime.
struct InFlight {
    sched_rev: i64,
    cancel: Cancel,
}

/// Which serving instances without attempts [`Running::retire_unowned`]
/// looks up.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Candidates {
    All,
    /// Only those in [`Running::look_again`].
    LookAgain,
}

/// The loop's state.
struct Running {
    shared: Arc<Shared>,
    intake: Intake,
    store: Store<SwapAttempt>,
    /// Whether the watch has delivered its first full list.
    synced: bool,
    in_flight: HashMap<InstanceKey, InFlight>,
    runners: JoinSet<()>,
    reports: JoinSet<()>,
    /// Instances whose InstanceGeneration is being looked up or stopped.
    retiring: HashSet<InstanceKey>,
    /// Instances without attempts whose last lookup or stop failed, or
    /// found them still wanted: looked at again on a timer. Nothing else
    /// would bring them up again: the deletions that made them candidates
    /// are over, and an InstanceGeneration deleted after the lookup (as a
    /// namespace's deletion may do, its attempts first) sends this agent no
    /// event.
    look_again: HashSet<InstanceKey>,
    retirements: JoinSet<(InstanceKey, Retirement)>,
    /// Supervisor states that came before the watch's first full list.
    serving_before_sync: Vec<ServingChange>,
    /// The `serving` write being retried per attempt (namespace, name).
    serving_writes: HashMap<(String, String), tokio::task::AbortHandle>,
    /// Stage-only attempts this agent took, by (namespace, name), until
    /// they are deleted.
    asks: HashMap<(String, String), Ask>,
    stages: JoinSet<StagedAhead>,
    /// Stage-only attempts seen before this agent owned the node: staging
    /// writes the store, which only the owner may.
    stage_pending: Vec<Arc<SwapAttempt>>,
    owns_node: bool,
}

impl KubeAgent {
    /// The agent over `client`. `readiness` and `metrics` are what the
    /// operations endpoints serve.
    pub fn new(
        client: Client,
        engine: Arc<Engine>,
        gate: Arc<NewestRevisionGate>,
        config: KubeAgentConfig,
        metrics: Arc<AgentMetrics>,
        readiness: Readiness,
    ) -> Self {
        Self {
            client,
            engine,
            gate,
            config,
            metrics,
            readiness,
        }
    }

    /// Runs until `shutdown` resolves, then shuts down as the module docs
    /// say. Returns an error when the node lock or the journal fails.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), KubeAgentError> {
        let KubeAgent {
            client,
            engine,
            gate,
            config,
            metrics,
            readiness,
        } = self;
        config.validate()?;
        let attempts = match &config.inbox_namespace {
            Some(inbox_namespace) => attempts_from_inbox(
                client.clone(),
                InboxSource {
                    inbox_namespace: inbox_namespace.clone(),
                    node_name: config.node_name.clone(),
                    attempts_namespace: config.namespace.clone(),
                },
            )
            .boxed(),
            None => {
                let api: Api<SwapAttempt> = match &config.namespace {
                    Some(namespace) => Api::namespaced(client.clone(), namespace),
                    None => Api::all(client.clone()),
                };
                let selector = format!("spec.nodeName={}", config.node_name);
                // MostRecent (a quorum read) is what lets an attempt run on
                // its watched copy: a list from the watch cache could predate
                // its outcome.
                watcher(
                    api,
                    watcher::Config::default()
                        .fields(&selector)
                        .list_semantic(watcher::ListSemantic::MostRecent),
                )
                .boxed()
            }
        };
        let (store, writer) = reflector::store();
        let mut events = reconnecting(reflector(writer, attempts)).boxed();

        let (ended_tx, mut ended_rx) = mpsc::unbounded_channel();
        let reporter = Reporter::new(
            client.clone(),
            engine.clone(),
            config.report_backoff,
            metrics.clone(),
        );
        let mut state = Running {
            shared: Arc::new(Shared {
                client,
                engine,
                gate: gate.clone(),
                reporter,
                metrics,
                config: config.clone(),
                ended: ended_tx,
                stage_slot: Arc::new(tokio::sync::Semaphore::new(1)),
            }),
            intake: Intake::new(config.node_name.clone(), gate.clone()),
            store,
            synced: false,
            in_flight: Default::default(),
            runners: JoinSet::new(),
            reports: JoinSet::new(),
            retiring: HashSet::new(),
            look_again: HashSet::new(),
            retirements: JoinSet::new(),
            serving_before_sync: Vec::new(),
            serving_writes: HashMap::new(),
            asks: HashMap::new(),
            stages: JoinSet::new(),
            stage_pending: Vec::new(),
            owns_node: false,
        };
        let mut retire_retry = tokio::time::interval(config.look_again);
        retire_retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        let lock_path = config.lock_path.clone();
        let lock_wait = NodeLock::acquire(&lock_path);
        tokio::pin!(lock_wait);
        tokio::pin!(shutdown);
        let mut lock: Option<NodeLock> = None;
        tracing::info!(lock = %lock_path.display(), "waiting for the node lock");
        let (supervisor_tx, mut supervisor_rx) = mpsc::unbounded_channel();
        let mut supervisor: Option<Supervisor> = None;

        let ended_with = loop {
            tokio::select! {
                () = &mut shutdown => break Ok(()),
                acquired = &mut lock_wait, if lock.is_none() => match acquired {
                    Ok(held) => {
                        lock = Some(held);
                        tracing::info!(lock = %lock_path.display(), "this agent owns the node");
                        if let Err(error) = state.take_ownership().await {
                            break Err(error);
                        }
                        // After recovery: it supervises what recovery adopted
                        // and what died while no agent ran.
                        let events = supervisor_tx.clone();
                        supervisor = Some(state.shared.engine.start_supervisor(
                            gate.clone(),
                            move |event| {
                                let _ = events.send(event);
                            },
                        ));
                        readiness.set_owner(true);
                    }
                    Err(error) => break Err(KubeAgentError::Ownership(error)),
                },
                event = events.next() => match event {
                    Some(Ok(event)) => state.on_watch_event(event, &readiness),
                    Some(Err(error)) => tracing::warn!(
                        error = %error_chain(&error),
                        "watching SwapAttempts failed; retrying with backoff"
                    ),
                    None => break Err(KubeAgentError::WatchEnded),
                },
                Some(ended) = ended_rx.recv() => state.on_ended(ended),
                Some(event) = supervisor_rx.recv() => state.on_supervisor(event),
                Some(_) = state.runners.join_next(), if !state.runners.is_empty() => {}
                Some(_) = state.reports.join_next(), if !state.reports.is_empty() => {}
                Some(done) = state.retirements.join_next(), if !state.retirements.is_empty() => {
                    state.on_retired(done);
                }
                Some(done) = state.stages.join_next(), if !state.stages.is_empty() => {
                    state.on_staged(done);
                }
                _ = retire_retry.tick() => state.retire_unowned(Candidates::LookAgain),
            }
        };

        // No restart begins while the attempts are cancelled and drained.
        drop(supervisor);
        state.shut_down(&mut ended_rx).await;
        state.shared.engine.close_logs().await;
        readiness.set_owner(false);
        gate.set_owner(false);
        // Released last: the journal is not written after this.
        drop(lock);
        ended_with
    }
}

impl Running {
    /// The node lock is held: deliver what the journal holds, then decide
    /// every attempt the watch has seen.
    async fn take_ownership(&mut self) -> Result<(), KubeAgentError> {
        // Before anything runs: adopt what serves and finish what a killed
        // agent left in flight (SPEC 5.7); the outcomes it decides are among
        // the pending ones read below.
        self.shared.engine.recover().await;
        self.shared.gate.set_owner(true);
        let engine = self.shared.engine.clone();
        let (entries, corrupt) = tokio::task::spawn_blocking(move || engine.journal().load_all())
            .await
            .map_err(KubeAgentError::JournalTask)?
            .map_err(KubeAgentError::Journal)?;
        for bad in &corrupt {
            tracing::error!(
                path = %bad.path.display(),
                error = %bad.error,
                "a journal file cannot be read; recovery must quarantine it"
            );
        }
        for entry in &entries {
            for record in entry.pending_reports() {
                self.intake
                    .mark_decided(&record.instance, record.attempt.sched_rev);
                if let Some(report) = OutcomeReport::from_record(&record) {
                    tracing::info!(
                        attempt = %report.target,
                        outcome = ?report.outcome.outcome,
                        "delivering an outcome the journal still holds"
                    );
                    self.deliver(report);
                }
            }
            if let Some(record) = entry.attempt.as_ref().filter(|r| r.outcome.is_none()) {
                self.intake
                    .mark_decided(&record.instance, record.attempt.sched_rev);
                tracing::warn!(
                    instance = %record.instance,
                    attempt = %record.attempt.name,
                    phase = record.phase.name(),
                    "an attempt was left in flight by the previous agent; it is not run again, recovery finishes it"
                );
            }
        }
        self.intake.open();
        self.owns_node = true;
        for attempt in std::mem::take(&mut self.stage_pending) {
            self.stage_ahead(attempt);
        }
        self.offer_all();
        self.retire_unowned(Candidates::All);
        self.shared
            .metrics
            .set_generations_running(self.shared.engine.instances().len());
        Ok(())
    }

    fn on_watch_event(&mut self, event: watcher::Event<SwapAttempt>, readiness: &Readiness) {
        match event {
            watcher::Event::Apply(ask) | watcher::Event::InitApply(ask) if ask.spec.stage_only => {
                self.stage_ahead(Arc::new(ask));
            }
            watcher::Event::Delete(ask) if ask.spec.stage_only => {
                let key = attempt_key(&ask);
                self.stage_pending.retain(|a| attempt_key(a) != key);
                if let Some(Ask::Staging(task)) = self.asks.remove(&key) {
                    task.abort();
                }
                // Gone with the node's swap attempt (which keeps the build
                // while it runs), a newer build, or its IG.
                self.shared.engine.keep_prestaged(&holder(&key), Vec::new());
            }
            watcher::Event::Apply(attempt) => {
                let decisions = self.intake.offer(Arc::new(attempt));
                self.execute(decisions);
            }
            watcher::Event::Delete(attempt) => {
                let written = (
                    attempt.metadata.namespace.clone().unwrap_or_default(),
                    attempt.metadata.name.clone().unwrap_or_default(),
                );
                if let Some(write) = self.serving_writes.remove(&written) {
                    write.abort();
                }
                let decisions = self.intake.delete(&attempt);
                self.execute(decisions);
                self.retire_unowned(Candidates::All);
            }
            // Decided once the list is complete, so the newest revision of
            // every instance is known before anything runs.
            watcher::Event::InitApply(attempt) => self.intake.observe(&attempt),
            watcher::Event::Init => {}
            watcher::Event::InitDone => {
                readiness.set_synced(true);
                self.synced = true;
                self.offer_all();
                self.retire_unowned(Candidates::All);
                for change in std::mem::take(&mut self.serving_before_sync) {
                    self.write_serving(change);
                }
            }
        }
    }

    /// What the supervisor did: logged, counted, and a lineage's state
    /// written as the `serving` block of the attempt that installed it.
    fn on_supervisor(&mut self, event: SupervisorEvent) {
        crate::engine::log_event(&event);
        self.shared.metrics.record_supervisor_event(&event);
        if matches!(event, SupervisorEvent::Restarted { .. }) && self.synced {
            // An instance whose InstanceGeneration went while it was down
            // serves again: it is looked up like any other that no attempt
            // names.
            self.retire_unowned(Candidates::All);
        }
        if let SupervisorEvent::Serving(change) = event {
            if self.synced {
                self.write_serving(*change);
            } else {
                // Compared with the attempts once the watch has them all.
                self.serving_before_sync.push(*change);
            }
        }
    }

    /// Writes `change` unless the attempt already says it; a newer change of
    /// the same attempt replaces a write still being retried.
    fn write_serving(&mut self, change: ServingChange) {
        let namespace = change.instance.namespace().to_string();
        let name = change.attempt().name.clone();
        let serving = serving_status(
            &change.supervised,
            change.last_exit.as_ref(),
            &change.sidecars,
        );
        let cached = self
            .store
            .get(&ObjectRef::new(&name).within(&namespace))
            .and_then(|attempt| attempt.status.clone());
        if cached.is_some_and(|status| already_says(status.serving.as_ref(), &serving)) {
            return;
        }
        if let Some(previous) = self
            .serving_writes
            .remove(&(namespace.clone(), name.clone()))
        {
            previous.abort();
        }
        let reporter = self.shared.reporter.clone();
        let target = ServingTarget {
            namespace: namespace.clone(),
            name: name.clone(),
        };
        let handle = self.reports.spawn(async move {
            reporter.deliver_serving(&target, &serving).await;
        });
        self.serving_writes.insert((namespace, name), handle);
    }

    /// Looks up the InstanceGeneration of every serving instance that no
    /// cached attempt names (see [`retire`]), and stops those that are gone.
    /// An instance whose object exists is looked at again only on the next
    /// deletion or relist, not on the retry timer.
    fn retire_unowned(&mut self, which: Candidates) {
        if !self.synced || !self.intake.is_open() {
            return;
        }
        // Outside the watched namespace there are no attempts to see, and
        // no right to read the object.
        let scope = self.shared.config.namespace.as_deref();
        let serving: Vec<InstanceKey> = self
            .shared
            .engine
            .instances()
            .into_iter()
            .filter(|key| scope.is_none_or(|namespace| key.namespace() == namespace))
            .collect();
        let cached = self.store.state();
        let mut candidates = retire::unowned(&serving, cached.iter().map(|a| a.as_ref()), |key| {
            self.in_flight.contains_key(key) || self.retiring.contains(key)
        });
        // One that has an attempt again needs no second look.
        self.look_again
            .retain(|key| candidates.contains(key) || self.retiring.contains(key));
        if which == Candidates::LookAgain {
            candidates.retain(|key| self.look_again.contains(key));
        }
        for instance in candidates {
            self.retiring.insert(instance.clone());
            let shared = self.shared.clone();
            self.retirements.spawn(retire_instance(shared, instance));
        }
    }

    fn on_retired(&mut self, done: Result<(InstanceKey, Retirement), tokio::task::JoinError>) {
        let Ok((instance, retirement)) = done else {
            // A panicked lookup names no instance: let every one be looked
            // at again on the next deletion, end or relist.
            self.retiring.clear();
            return;
        };
        self.retiring.remove(&instance);
        self.shared.metrics.record_retirement(retirement);
        if retirement == Retirement::Stopped {
            self.look_again.remove(&instance);
        } else {
            self.look_again.insert(instance.clone());
        }
        self.shared
            .metrics
            .set_generations_running(self.shared.engine.instances().len());
    }

    /// Offers every swap attempt in the watch cache, oldest revision first.
    /// Asks to stage ahead are not swaps: [`Running::stage_ahead`] has them.
    fn offer_all(&mut self) {
        if !self.intake.is_open() {
            return;
        }
        let mut attempts = self.store.state();
        attempts.retain(|attempt| !attempt.spec.stage_only);
        attempts.sort_by_key(|a| a.spec.sched_rev);
        for attempt in attempts {
            let decisions = self.intake.offer(attempt);
            self.execute(decisions);
        }
    }

    fn on_ended(&mut self, ended: Ended) {
        if self
            .in_flight
            .get(&ended.instance)
            .is_some_and(|f| f.sched_rev == ended.sched_rev)
        {
            self.in_flight.remove(&ended.instance);
        }
        if let Some(report) = ended.report {
            self.deliver(report);
        }
        if let Some(change) = ended.serving {
            // A supervisor's write for it (an exit right after the switch)
            // is newer than the state the attempt ended with.
            let key = (
                change.instance.namespace().to_string(),
                change.attempt().name.clone(),
            );
            if !self.serving_writes.contains_key(&key) {
                self.write_serving(change);
            }
        }
        self.shared
            .metrics
            .set_generations_running(self.shared.engine.instances().len());
        let decisions = self.intake.finished(&ended.instance, ended.sched_rev);
        self.execute(decisions);
        // Its attempt may have been deleted with its InstanceGeneration
        // while it ran.
        self.retire_unowned(Candidates::All);
    }

    fn execute(&mut self, decisions: Vec<Decision>) {
        for decision in decisions {
            match decision {
                Decision::Run { instance, attempt } => {
                    let cancel = Cancel::new();
                    self.in_flight.insert(
                        instance.clone(),
                        InFlight {
                            sched_rev: attempt.spec.sched_rev,
                            cancel: cancel.clone(),
                        },
                    );
                    let shared = self.shared.clone();
                    self.runners
                        .spawn(run_attempt(shared, instance, attempt, cancel));
                }
                Decision::Abandon {
                    instance,
                    attempt,
                    reason,
                } => {
                    let target = ReportTarget::of_attempt(&attempt, instance);
                    tracing::info!(attempt = %target, %reason, "abandoned without running");
                    self.shared
                        .metrics
                        .record_outcome(Outcome::Abandoned, effective_mode(&attempt.spec));
                    self.deliver(OutcomeReport::abandoned_unrun(
                        target,
                        &attempt.spec,
                        reason,
                    ));
                }
                Decision::Cancel {
                    instance,
                    sched_rev,
                    why,
                } => {
                    if let Some(running) = self
                        .in_flight
                        .get(&instance)
                        .filter(|f| f.sched_rev == sched_rev)
                    {
                        tracing::info!(%instance, sched_rev, %why, "cancelling a running attempt");
                        running.cancel.cancel(why);
                    }
                }
            }
        }
    }

    /// Stages a stage-only attempt's build in the background and reports
    /// on the attempt; one with an outcome has been staged already.
    fn stage_ahead(&mut self, attempt: Arc<SwapAttempt>) {
        if let Some(outcome) = attempt.status.as_ref().and_then(|s| s.outcome) {
            // Staged by an agent before this one: kept until its swap.
            if outcome == Outcome::Done {
                self.shared.engine.keep_prestaged(
                    &holder(&attempt_key(&attempt)),
                    vec![attempt.spec.build.sha256.clone()],
                );
            }
            return;
        }
        let key = attempt_key(&attempt);
        if !self.owns_node {
            self.stage_pending.retain(|a| attempt_key(a) != key);
            self.stage_pending.push(attempt);
            return;
        }
        if self.asks.contains_key(&key) {
            return;
        }
        let task = self.stages.spawn(stage_ahead(self.shared.clone(), attempt));
        self.asks.insert(key, Ask::Staging(task));
    }

    /// A stage ended: the build is kept from retention while its ask
    /// stands, and the outcome is written. Decided here, not in the task,
    /// so an ask deleted meanwhile leaves no holder behind.
    fn on_staged(&mut self, done: Result<StagedAhead, tokio::task::JoinError>) {
        // Aborted: its ask was deleted, or the agent is shutting down.
        let Ok(StagedAhead { attempt, status }) = done else {
            return;
        };
        let key = attempt_key(&attempt);
        match self.asks.get_mut(&key) {
            Some(ask @ Ask::Staging(_)) => *ask = Ask::Finished,
            _ => return,
        }
        if status.outcome == Some(Outcome::Done) {
            self.shared
                .engine
                .keep_prestaged(&holder(&key), vec![attempt.spec.build.sha256.clone()]);
        }
        let reporter = self.shared.reporter.clone();
        self.reports.spawn(async move {
            let target = ReportTarget::of_attempt(&attempt, None);
            reporter.deliver_status(&target, &status).await;
        });
    }

    fn deliver(&mut self, report: OutcomeReport) {
        let reporter = self.shared.reporter.clone();
        self.reports.spawn(async move {
            reporter.deliver(&report).await;
        });
    }

    /// Stop taking attempts, cancel those in flight and wait for them, flush
    /// outcomes for a while.
    async fn shut_down(&mut self, ended_rx: &mut mpsc::UnboundedReceiver<Ended>) {
        tracing::info!(
            in_flight = self.in_flight.len(),
            "shutting down: no new attempts; cancelling those in flight"
        );
        self.shared.gate.set_shutting_down();
        self.intake.close();
        // A stage cut short leaves no entry; the next agent stages it again.
        self.stages.abort_all();
        while self.stages.join_next().await.is_some() {}
        for running in self.in_flight.values() {
            running.cancel.cancel("the agent is shutting down");
        }
        let deadline = Instant::now() + self.shared.config.shutdown_timeout;
        while !self.runners.is_empty() {
            tokio::select! {
                Some(ended) = ended_rx.recv() => self.on_ended(ended),
                Some(_) = self.runners.join_next() => {}
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        left = self.runners.len(),
                        "cancelled attempts did not end in time; recovery finishes them on the next start"
                    );
                    self.runners.abort_all();
                    while self.runners.join_next().await.is_some() {}
                }
            }
        }
        while !self.retirements.is_empty() {
            tokio::select! {
                Some(done) = self.retirements.join_next() => self.on_retired(done),
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(
                        left = self.retirements.len(),
                        "stopping instances no longer wanted on this node did not finish in time; the next agent looks again"
                    );
                    self.retirements.abort_all();
                    while self.retirements.join_next().await.is_some() {}
                }
            }
        }
        while let Ok(ended) = ended_rx.try_recv() {
            self.on_ended(ended);
        }
        let flush_until = Instant::now() + self.shared.config.report_flush;
        while !self.reports.is_empty() {
            tokio::select! {
                Some(_) = self.reports.join_next() => {}
                () = tokio::time::sleep_until(flush_until) => {
                    tracing::warn!(
                        left = self.reports.len(),
                        "outcomes not yet accepted stay in the journal for the next start"
                    );
                    self.reports.abort_all();
                    while self.reports.join_next().await.is_some() {}
                }
            }
        }
        tracing::info!("shut down; serving generations keep running");
    }
}

/// Stops `instance` if its InstanceGeneration is gone or no longer selects
/// this node.
async fn retire_instance(shared: Arc<Shared>, instance: InstanceKey) -> (InstanceKey, Retirement) {
    let node_name = &shared.config.node_name;
    let retirement = match retire::look_up(&shared.client, &instance, node_name).await {
        Owner::Present => Retirement::Kept,
        Owner::Unknown(error) => {
            tracing::warn!(%instance, %error, "cannot tell whether the instance is still wanted on this node; it keeps serving");
            Retirement::Failed
        }
        owner @ (Owner::Gone(_) | Owner::Unselected) => {
            let why = match owner {
                Owner::Gone(why) => why,
                _ => "this node no longer matches its InstanceGeneration's nodeSelector",
            };
            tracing::info!(%instance, "{why}; stopping the instance");
            // As the attempt that started it said: journaled with the
            // generation, so it holds across agent restarts.
            let stop = shared
                .engine
                .serving(&instance)
                .map(|serving| serving.stop)
                .unwrap_or_default();
            match shared.engine.stop_instance(&instance, &stop).await {
                Ok(drain) => {
                    tracing::info!(%instance, drain_ms = ?drain.map(|d| d.as_millis()), "instance stopped");
                    Retirement::Stopped
                }
                // An attempt took the instance meanwhile: the object was
                // re-created and wants it.
                Err(EngineError::Busy { .. }) => Retirement::Kept,
                Err(error) => {
                    tracing::error!(%instance, %error, "the instance could not be stopped; trying again later");
                    Retirement::Failed
                }
            }
        }
    };
    (instance, retirement)
}

/// Sends [`Ended`] when dropped, so the loop learns of every end, a panic
/// included.
struct EndGuard {
    shared: Arc<Shared>,
    instance: InstanceKey,
    sched_rev: i64,
    report: Option<OutcomeReport>,
    serving: Option<ServingChange>,
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        let _ = self.shared.ended.send(Ended {
            instance: self.instance.clone(),
            sched_rev: self.sched_rev,
            report: self.report.take(),
            serving: self.serving.take(),
        });
    }
}

/// Who keeps a stage-only attempt's build from retention.
fn holder((namespace, name): &(String, String)) -> String {
    format!("attempt {namespace}/{name}")
}

/// (namespace, name) of an attempt.
fn attempt_key(attempt: &SwapAttempt) -> (String, String) {
    (
        attempt.metadata.namespace.clone().unwrap_or_default(),
        attempt.metadata.name.clone().unwrap_or_default(),
    )
}

/// A stage-only attempt's task: waits its turn, stages, and writes the
/// progress (the newest only, one write at a time); the loop writes the
/// outcome it returns.
async fn stage_ahead(shared: Arc<Shared>, attempt: Arc<SwapAttempt>) -> StagedAhead {
    // Never closed; closed, it would only lift the one-at-a-time rule.
    let _turn = shared.stage_slot.clone().acquire_owned().await.ok();
    let target = ReportTarget::of_attempt(&attempt, None);
    tracing::info!(attempt = %target, build = %attempt.spec.build.id, "staging ahead of the rollout");
    let (shown, mut to_write) = tokio::sync::watch::channel(None);
    let stage = crate::prestage::stage_ahead(
        shared.engine.stager(),
        &attempt.spec.build,
        Some(&shared.metrics),
        move |status| {
            shown.send_replace(Some(status));
        },
    );
    let writes = async {
        while to_write.changed().await.is_ok() {
            let Some(status) = to_write.borrow_and_update().clone() else {
                continue;
            };
            if let Err(error) = shared.reporter.apply(&target, &status).await {
                if error.is_not_found() {
                    return;
                }
                tracing::debug!(attempt = %target, error = %error_chain(&error), "writing a stage's progress failed; the next one carries it");
            }
        }
    };
    let (status, ()) = tokio::join!(stage, writes);
    StagedAhead { attempt, status }
}

/// One attempt's task: the running status, the swap, the
/// outcome handed to the loop.
async fn run_attempt(
    shared: Arc<Shared>,
    instance: InstanceKey,
    attempt: Arc<SwapAttempt>,
    cancel: Cancel,
) {
    let mut guard = EndGuard {
        shared: shared.clone(),
        instance: instance.clone(),
        sched_rev: attempt.spec.sched_rev,
        report: None,
        serving: None,
    };
    if let Some((report, serving)) = swap(&shared, instance, &attempt, &cancel).await {
        guard.report = Some(report);
        guard.serving = serving;
    }
}

async fn swap(
    shared: &Shared,
    instance: InstanceKey,
    attempt: &SwapAttempt,
    cancel: &Cancel,
) -> Option<(OutcomeReport, Option<ServingChange>)> {
    // The watched copy is current enough to run: the watch's lists are
    // quorum reads, its events come in order after them, and an attempt
    // with an outcome, one the journal holds, or one this agent took never
    // reaches here (intake.rs). A read from the server would only repeat
    // what the watch said.
    let name = attempt.metadata.name.clone().unwrap_or_default();
    let target = ReportTarget::of_attempt(attempt, Some(instance.clone()));
    let engine_attempt = Attempt {
        instance,
        name,
        spec: attempt.spec.clone(),
        restart: None,
    };
    let mode = engine_attempt.effective_mode();
    tracing::info!(
        attempt = %target,
        build = %engine_attempt.spec.build.id,
        ?mode,
        cause = ?engine_attempt.spec.cause,
        "running"
    );
    let swap_over = Cancel::new();
    let run = async {
        let result = shared
            .engine
            .swap(&engine_attempt, shared.gate.as_ref(), cancel)
            .await;
        swap_over.cancel("the attempt finished");
        result
    };
    let started_at_ms = unix_millis_now();
    let started = async {
        let delay = shared.config.running_report_delay;
        if !delay.is_zero() {
            tokio::select! {
                () = swap_over.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
        shared
            .reporter
            .report_started(&target, mode, started_at_ms, &swap_over)
            .await;
    };
    let (result, ()) = tokio::join!(run, started);
    shared.metrics.record_result(&result);
    tracing::info!(
        attempt = %target,
        outcome = ?result.outcome,
        mode = ?result.effective_mode,
        executed = result.executed,
        generation = result.generation,
        reason = %result.reason,
        "attempt ended"
    );
    let sidecars = shared.engine.sidecars(&engine_attempt.instance);
    let serving = ServingChange::installed(&engine_attempt, &result, sidecars);
    Some((OutcomeReport::from_result(target, &result), serving))
}
