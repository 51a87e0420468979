//! One attempt's run: the step bookkeeping every mode shares, the intake
//! (swaps off, mid-operation, the effective mode's first journal write), the
//! successor's start (cgroup, gate, exec, identity, health, settle), and the
//! outcome.

use std::future::Future;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use genswap_crds::{InstanceKind, Mode, Outcome};

use super::parts::{self, Staged};
use super::types::{Attempt, Step, StepRecord, SwapResult};
use super::{Cancel, Engine, Process, Running, hold, overlap};
use crate::cgroup::Tier;
use crate::classify::{AdmissionRefusal, StepError, StepOutcome, classify};
use crate::gate::{AttemptGate, GatePoint};
use crate::health::HealthError;
use crate::journal::{
    AttemptRef, AttemptWrite, Durability, GenerationRecord, OutcomeRecord, Phase, Record,
    unix_millis_now,
};
use crate::probe::{Probe, ProbeError};

/// An attempt that ended before its mode's last step: what the classifier
/// made of the error, and the error.
#[derive(Debug)]
pub(super) struct Ended {
    pub(super) outcome: StepOutcome,
    pub(super) error: StepError,
}

/// How a mode's flow ended well.
#[derive(Debug, Default)]
pub(super) struct Finished {
    /// A worker's one-shot exited 0 inside its window.
    pub(super) clean_exit: bool,
    /// Said beside a `done` (a retiring generation that needed
    /// `cgroup.kill`, a parent that could not be restored).
    pub(super) note: String,
}

/// The successor after its start: serving, or a worker's one-shot that
/// already exited 0.
pub(super) enum Started {
    Serving(Box<Running>),
    CleanExit,
}

/// What a step's work may borrow: the attempt's fixed context.
#[derive(Clone, Copy)]
pub(super) struct Ctx<'a> {
    pub(super) engine: &'a Engine,
    pub(super) attempt: &'a Attempt,
    pub(super) gate: &'a dyn AttemptGate,
    pub(super) cancel: &'a Cancel,
}

impl Ctx<'_> {
    /// Asks the gate at `point`; a cancelled attempt goes no further either.
    pub(super) fn check_gate(&self, point: GatePoint) -> Result<(), StepError> {
        if let Some(why) = self.cancel.reason() {
            return Err(StepError::Cancelled(why));
        }
        let checked = if self.attempt.restart.is_some() {
            self.gate.check_restart(point, &self.attempt.instance)
        } else {
            self.gate.check(point, &self.attempt.id())
        };
        checked.map_err(|refusal| StepError::Gate { point, refusal })
    }
}

/// One attempt in progress: its context and what it has found out so far.
pub(super) struct Run<'a> {
    pub(super) engine: &'a Engine,
    pub(super) attempt: &'a Attempt,
    pub(super) gate: &'a dyn AttemptGate,
    pub(super) cancel: &'a Cancel,
    pub(super) mode: Mode,
    pub(super) steps: Vec<StepRecord>,
    /// The tri-state evidence: `false` only while it is proven that nothing
    /// of the build started.
    pub(super) executed: bool,
    pub(super) generation: Option<u64>,
    pub(super) drain: Option<Duration>,
    /// The successor starts while another generation serves: a steered
    /// listener gives it a socket of its own.
    pub(super) beside_serving: bool,
    /// A serving incumbent was stopped by this attempt: a build failure from
    /// here on is `down`.
    pub(super) incumbent_stopped: bool,
    pub(super) record: Record,
    /// A change of the serving generation the journal does not hold yet:
    /// the next write of the record carries it.
    pub(super) serving_now: Option<Option<GenerationRecord>>,
    /// A write still running in the background (the `spawned` phase, while
    /// health runs); every later write waits for it, so phases land in order.
    pending_write: Option<tokio::task::JoinHandle<()>>,
    /// The successor's log shim, starting while the intent is written.
    log_shim: Option<LogShimStart>,
    started_at: SystemTime,
}

/// A log shim's start running on a blocking thread.
type LogShimStart =
    tokio::task::JoinHandle<Result<crate::logs::GenerationOutput, crate::logs::LogError>>;

/// Runs `attempt` to its end (see the engine's module docs).
pub(super) async fn run(
    engine: &Engine,
    attempt: &Attempt,
    gate: &dyn AttemptGate,
    cancel: &Cancel,
) -> SwapResult {
    let started_at = SystemTime::now();
    let mode = attempt.effective_mode();
    if !engine.config.swaps_on {
        return refused_at_intake(mode, started_at, StepError::SwapsOff);
    }
    let Some(mut claim) = engine.claim(&attempt.instance) else {
        return refused_at_intake(
            mode,
            started_at,
            StepError::Admission(AdmissionRefusal::Busy),
        );
    };
    let mut record = Record::admitted(
        attempt.instance.clone(),
        AttemptRef {
            name: attempt.name.clone(),
            uid: None,
            sched_rev: attempt.spec.sched_rev,
        },
        attempt.spec.cause,
        attempt.spec.kind,
        attempt.spec.mode,
        mode,
    );
    record.restart = attempt.restart;
    record.spec = Some(Box::new(attempt.spec.clone()));
    record.incumbent = claim.serving.as_ref().map(|running| running.record.clone());
    // Recovery stops what this attempt leaves behind the way the attempt
    // would have.
    record.stop = Some(attempt.spec.stop.clone());
    let mut run = Run {
        engine,
        attempt,
        gate,
        cancel,
        mode,
        steps: Vec::new(),
        executed: false,
        generation: None,
        drain: None,
        beside_serving: false,
        incumbent_stopped: false,
        record,
        serving_now: None,
        pending_write: None,
        log_shim: None,
        started_at,
    };
    // SPEC 5.2: the effective mode is on disk before anything else happens,
    // so a failure is booked under the mode that actually ran. An agent that
    // dies now finds it; a node crash loses nothing by undoing it.
    let write = run.write_journal(Durability::Ordered);
    if let Err(ended) = run.step(Step::Journal, false, write).await {
        return run.end(ended, false).await;
    }
    crate::failpoint!(run.crash_scope(), "admitted");
    let flow = match mode {
        Mode::Overlap => overlap::run(&mut run, &mut claim).await,
        Mode::Hold => hold::run(&mut run, &mut claim).await,
    };
    let result = match flow {
        Ok(finished) => {
            // The new generation's listeners are the instance's now.
            engine
                .listeners
                .keep_only(&attempt.instance, &attempt.spec.listeners)
                .await;
            run.done(finished).await
        }
        Err(ended) => {
            // A socket bound for the successor that did not take over.
            engine.listeners.forget_beside(&attempt.instance);
            run.end(ended, true).await
        }
    };
    if claim.serving.is_none() {
        parts::remove_empty_instance(engine, &attempt.instance);
    }
    drop(claim);
    // The next generation's log shim starts now, between attempts, not on
    // the next swap's path.
    engine.logs.prepare_spare();
    result
}

/// An attempt refused before the engine took it: nothing was journaled,
/// nothing touched the host.
fn refused_at_intake(mode: Mode, started_at: SystemTime, error: StepError) -> SwapResult {
    let result: Result<(), StepError> = Err(error);
    let outcome = classify(&result, false);
    let reason = result.err().map(|e| reason_of(&e)).unwrap_or_default();
    SwapResult {
        outcome: outcome_of(outcome, false),
        effective_mode: mode,
        generation: None,
        reason,
        executed: false,
        clean_exit: false,
        drain: None,
        listener_handover: None,
        steps: vec![StepRecord {
            step: Step::Admit,
            result: outcome,
            duration: Duration::ZERO,
        }],
        started_at,
        finished_at: SystemTime::now(),
    }
}

/// The attempt outcome for a step outcome (SPEC 5.4): a cancelled or stale
/// step abandons the attempt; a failed one is `down` when this attempt had
/// stopped the serving generation, `failed` otherwise.
pub(super) fn outcome_of(step: StepOutcome, incumbent_stopped: bool) -> Outcome {
    match step {
        StepOutcome::Ok => Outcome::Done,
        StepOutcome::Cancelled | StepOutcome::Stale => Outcome::Abandoned,
        StepOutcome::Failed if incumbent_stopped => Outcome::Down,
        StepOutcome::Failed => Outcome::Failed,
    }
}

/// An error and its sources as one line, each source said once.
pub(super) fn reason_of(error: &(dyn std::error::Error + 'static)) -> String {
    let mut reason = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !reason.contains(&text) {
            reason.push_str(": ");
            reason.push_str(&text);
        }
        source = cause.source();
    }
    reason
}

impl<'a> Run<'a> {
    /// Runs one step, records how it ended, and classifies its error.
    /// A cancellable step also ends when the attempt's lifetime does.
    pub(super) async fn step<T>(
        &mut self,
        step: Step,
        cancellable: bool,
        work: impl Future<Output = Result<T, StepError>>,
    ) -> Result<T, Ended> {
        let started = Instant::now();
        let result = if cancellable {
            let cancel = self.cancel;
            tokio::select! {
                biased;
                () = cancel.cancelled() => Err(StepError::Cancelled(
                    cancel.reason().unwrap_or_else(|| "the attempt was cancelled".into()),
                )),
                result = work => result,
            }
        } else {
            work.await
        };
        self.note(step, started, result)
    }

    /// Records a step that ran since `started` and ended with `result`,
    /// classified by the one classifier.
    pub(super) fn note<T>(
        &mut self,
        step: Step,
        started: Instant,
        result: Result<T, StepError>,
    ) -> Result<T, Ended> {
        let outcome = classify(&result, self.cancel.is_cancelled());
        self.steps.push(StepRecord {
            step,
            result: outcome,
            duration: started.elapsed(),
        });
        result.map_err(|error| Ended { outcome, error })
    }

    /// Writes the attempt's record, and a serving change not yet on file,
    /// after any write still in the background.
    pub(super) fn write_journal(
        &mut self,
        durability: Durability,
    ) -> impl Future<Output = Result<(), StepError>> + 'static {
        self.write_journal_with(AttemptWrite {
            durability,
            ..AttemptWrite::default()
        })
    }

    fn write_journal_with(
        &mut self,
        mut write: AttemptWrite,
    ) -> impl Future<Output = Result<(), StepError>> + 'static {
        let journal = Arc::clone(&self.engine.journal);
        let record = self.record.clone();
        write.serving = self.serving_now.take().or(write.serving);
        let pending = self.pending_write.take();
        async move {
            if let Some(pending) = pending {
                // Its error was logged where it ran.
                let _ = pending.await;
            }
            parts::blocking(move || journal.write_attempt(&record, write))
                .await
                .map_err(StepError::Journal)
        }
    }

    /// Moves the record to `phase` and writes it (ordered: none of these
    /// phases needs to outlive a node crash), for a phase whose action must
    /// go on even when the journal cannot say so (a switch that happened, a
    /// retirement that is owed): a failed write is logged, and recovery
    /// works from the host.
    pub(super) async fn advance_after_exec(&mut self, phase: Phase) {
        self.record.advance(phase);
        let write = self.write_journal(Durability::Ordered);
        if let Err(error) = write.await {
            log_unjournaled(&self.attempt.instance, &self.attempt.name, &error);
        }
    }

    /// [`advance_after_exec`](Self::advance_after_exec) without waiting:
    /// the write runs beside the next step, and the write after it waits
    /// for it.
    fn advance_in_background(&mut self, phase: Phase) {
        self.record.advance(phase);
        let write = self.write_journal(Durability::Ordered);
        let (instance, attempt) = (self.attempt.instance.clone(), self.attempt.name.clone());
        self.pending_write = Some(tokio::spawn(async move {
            if let Err(error) = write.await {
                log_unjournaled(&instance, &attempt, &error);
            }
        }));
    }

    /// Gets the successor's log shim in the background (the one the sink
    /// started ahead, or a new one when none waits): the agent's own
    /// process, so it may start before the intent is on file. Unused, it
    /// exits when its pipes close.
    pub(super) fn start_log_shim(&mut self) {
        if let Some(successor) = &self.record.successor {
            self.log_shim = Some(log_shim_start(self.ctx(), successor.n));
        }
    }

    /// Picks the successor's generation number and describes it in the
    /// record. Nothing is written here: the first write of the record
    /// (before anything of the successor exists on the host) keeps the
    /// journal's counter above it.
    pub(super) async fn reserve_generation(&mut self, staged: &Staged) -> Result<u64, StepError> {
        let journal = Arc::clone(&self.engine.journal);
        let instance = self.attempt.instance.clone();
        let n = parts::blocking(move || journal.next_generation(&instance))
            .await
            .map_err(StepError::Journal)?;
        let instance_cgroup = self.engine.cgroups.instance_handle(&self.attempt.instance);
        self.generation = Some(n);
        self.record.successor = Some(GenerationRecord {
            n,
            build: self.attempt.spec.build.id.clone(),
            sha256: staged.sha256.clone(),
            store_path: Some(staged.path.clone()),
            cgroup: instance_cgroup.generation(n).path().to_path_buf(),
            socket: self
                .engine
                .layout
                .generation_socket(&self.attempt.instance, n),
            config_rev: self.attempt.spec.config_rev.clone(),
            restart_id: self.attempt.spec.restart_id.clone(),
            serving_since_ms: None,
            stop: Some(self.attempt.spec.stop.clone()),
        });
        Ok(n)
    }

    /// SPEC 5.5 step 2 (and the hold's admission): the gate, the instance's
    /// own state, the successor's number, and the checks that can refuse
    /// the start before anything changes on the host. Returns the tier.
    pub(super) async fn admit(
        &mut self,
        incumbent: Option<&Running>,
        staged: &Staged,
    ) -> Result<Tier, StepError> {
        self.ctx().check_gate(GatePoint::Admission)?;
        if self.mode == Mode::Overlap
            && incumbent.is_some_and(|running| running.kind != InstanceKind::Instance)
        {
            return Err(StepError::Admission(AdmissionRefusal::NotAServer));
        }
        let n = self.reserve_generation(staged).await?;
        let tier = self.preflight(n).await?;
        if self.mode == Mode::Overlap && incumbent.is_some() {
            parts::check_probe_listener_steered(self.engine, self.attempt)?;
        }
        Ok(tier)
    }

    /// The checks that can refuse a start before anything changes on the
    /// host: the tier parses, its controllers are enabled, the uid is
    /// allowed. Run before an overlap's raise and before a hold's stop, so
    /// such a refusal never leaves the instance worse off.
    pub(super) async fn preflight(&self, n: u64) -> Result<Tier, StepError> {
        let tier = Tier::from_resources(&self.attempt.spec.resources)?;
        let instance = self.engine.cgroups.instance(&self.attempt.instance)?;
        instance.check_generation_limits(n, &tier)?;
        parts::check_user(&self.attempt.spec.process, self.engine.config.allow_root)?;
        parts::check_probes(self.attempt)?;
        let socket = self
            .engine
            .layout
            .generation_socket(&self.attempt.instance, n);
        if !crate::disk_name::socket_path_fits(&socket) {
            return Err(StepError::SocketPath { path: socket });
        }
        // Bound before anything changes, so a port in use refuses the
        // attempt while the incumbent still serves.
        self.engine
            .listeners
            .hold(&self.attempt.instance, &self.attempt.spec.listeners)
            .await?;
        Ok(tier)
    }

    /// The successor's start, SPEC 5.5 steps 5 to 7: a fresh `gen-<N>`
    /// cgroup, the gate, the exec, the identity check, health, and the
    /// settle window. On any error after the exec the successor is stopped
    /// with proof before this returns.
    pub(super) async fn start_successor(
        &mut self,
        staged: &Staged,
        tier: &Tier,
    ) -> Result<Started, Ended> {
        let Some(successor) = self.record.successor.clone() else {
            return Err(Ended {
                outcome: StepOutcome::Stale,
                error: StepError::Internal("the successor's generation was not reserved"),
            });
        };
        let log_shim = self
            .log_shim
            .take()
            .unwrap_or_else(|| log_shim_start(self.ctx(), successor.n));
        // Not cancellable: once the exec may have happened, the child's
        // handle must come back here, whatever the attempt's lifetime says.
        let spawned = self
            .step(
                Step::Spawn,
                false,
                spawn_successor(
                    self.ctx(),
                    &successor,
                    staged,
                    tier,
                    log_shim,
                    self.beside_serving,
                ),
            )
            .await;
        let mut running = match spawned {
            Ok(running) => {
                self.executed = true;
                running
            }
            Err(ended) => {
                self.executed |= parts::may_have_run(&ended.error);
                return Err(ended);
            }
        };
        crate::failpoint!(self.crash_scope(), "after_spawn");
        // The pid only helps a recovery adopt the right process; it lands
        // while the successor boots.
        self.advance_in_background(Phase::Spawned {
            pid: i32::try_from(running.process.pid()).unwrap_or(i32::MAX),
        });
        crate::failpoint!(self.crash_scope(), "before_health");

        let health = &self.attempt.spec.health;
        let timeout = Duration::from_secs(u64::try_from(health.timeout_seconds).unwrap_or(0));
        let probe = Probe::new(
            &health.action(),
            &parts::probe_generation(
                self.engine,
                &self.attempt.instance,
                &self.attempt.spec,
                &running,
            ),
        );
        let worker = self.attempt.spec.kind == InstanceKind::Worker;
        let healthy = self
            .step(
                Step::Health,
                true,
                healthy_or_exit(&mut running, probe, timeout, worker),
            )
            .await;
        match healthy {
            Ok(HealthEnd::Healthy) => {}
            Ok(HealthEnd::CleanExit) => {
                self.clean_up(running).await;
                return Ok(Started::CleanExit);
            }
            Err(ended) => {
                self.clean_up(running).await;
                return Err(ended);
            }
        }
        // Recovery keeps a hold's successor only once this is on file; an
        // overlap's recovery goes by where `current.sock` points, and its
        // reason names the phase on file: a kill in the settle window is
        // then told as after the health check, not as right after the exec.
        self.advance_after_exec(Phase::Healthy).await;
        crate::failpoint!(self.crash_scope(), "after_health");

        if self.attempt.settles() {
            let window =
                Duration::from_secs(u64::try_from(self.attempt.spec.settle.seconds).unwrap_or(0));
            let settled = self
                .step(Step::Settle, true, settle(&mut running, window, worker))
                .await;
            match settled {
                Ok(SettleEnd::Survived) => {}
                Ok(SettleEnd::CleanExit) => {
                    self.clean_up(running).await;
                    return Ok(Started::CleanExit);
                }
                Err(ended) => {
                    self.clean_up(running).await;
                    return Err(ended);
                }
            }
            crate::failpoint!(self.crash_scope(), "after_settle");
        }
        running.liveness = parts::liveness_of(
            self.engine,
            &self.attempt.instance,
            &self.attempt.spec,
            &running,
        );
        Ok(Started::Serving(Box::new(running)))
    }

    /// The parts of the run a step's future may borrow while the run
    /// records the step.
    pub(super) fn ctx(&self) -> Ctx<'a> {
        Ctx {
            engine: self.engine,
            attempt: self.attempt,
            gate: self.gate,
            cancel: self.cancel,
        }
    }

    /// Stops a successor that will not serve, with proof, and removes its
    /// cgroup and socket. A stop that cannot be proven is logged: the
    /// cgroup stays for recovery to find.
    pub(super) async fn clean_up(&mut self, running: Running) {
        let stop = self.attempt.spec.stop.clone();
        let n = running.record.n;
        if let Err((_, error)) = parts::stop_generation(running, &stop).await {
            tracing::error!(
                instance = %self.attempt.instance,
                generation = n,
                error = %reason_of(&error),
                "a successor that will not serve could not be proven stopped; its cgroup is left for recovery"
            );
        }
    }

    /// Ends the attempt `done`.
    async fn done(mut self, finished: Finished) -> SwapResult {
        let result = SwapResult {
            outcome: Outcome::Done,
            effective_mode: self.mode,
            generation: self.generation,
            reason: finished.note,
            executed: self.executed,
            clean_exit: finished.clean_exit,
            drain: self.drain,
            listener_handover: self
                .engine
                .listeners
                .handover_of(&self.attempt.instance, &self.attempt.spec.listeners),
            steps: std::mem::take(&mut self.steps),
            started_at: self.started_at,
            finished_at: SystemTime::now(),
        };
        self.finish_record(&result).await;
        result
    }

    /// Ends the attempt early with what the classifier made of `ended`.
    /// `journaled`: the attempt's record is on file and takes the outcome.
    async fn end(mut self, ended: Ended, journaled: bool) -> SwapResult {
        let mut reason = format!("{}: {}", self.last_step_name(), reason_of(&ended.error));
        if self.incumbent_stopped && ended.outcome != StepOutcome::Ok {
            reason.push_str(
                "; nothing serves: the former generation was stopped before this failure",
            );
        }
        let result = SwapResult {
            outcome: outcome_of(ended.outcome, self.incumbent_stopped),
            effective_mode: self.mode,
            generation: self.generation,
            reason,
            executed: self.executed,
            clean_exit: false,
            drain: self.drain,
            listener_handover: self
                .engine
                .listeners
                .handover_of(&self.attempt.instance, &self.attempt.spec.listeners),
            steps: std::mem::take(&mut self.steps),
            started_at: self.started_at,
            finished_at: SystemTime::now(),
        };
        if journaled {
            self.finish_record(&result).await;
        }
        result
    }

    /// The crash points' scope: the effective mode's name.
    pub(super) fn crash_scope(&self) -> &'static str {
        match self.mode {
            _ if self.attempt.restart.is_some() => "restart",
            Mode::Overlap => "overlap",
            Mode::Hold => "hold",
        }
    }

    fn last_step_name(&self) -> &'static str {
        self.steps
            .last()
            .map_or("intake", |record| record.step.as_str())
    }

    /// Writes the outcome into the record, where it stays until the adapter
    /// acknowledges it.
    async fn finish_record(&mut self, result: &SwapResult) {
        crate::failpoint!(self.crash_scope(), "before_finish");
        self.record.finish(OutcomeRecord {
            outcome: result.outcome,
            effective_mode: result.effective_mode,
            generation: result.generation,
            reason: result.reason.clone(),
            executed: result.executed,
            clean_exit: result.clean_exit,
            drain_ms: result.drain_ms(),
            listener_handover: result.listener_handover,
            steps: result.step_timings(),
            started_at_ms: millis_since_epoch(result.started_at),
            finished_at_ms: millis_since_epoch(result.finished_at),
        });
        let serving_after = result
            .generation
            .filter(|_| result.outcome == Outcome::Done && !result.clean_exit);
        let lineage = self.record.lineage_after(serving_after);
        // Durable: what is reported `done` is what a rebooted node starts.
        let write = self.write_journal_with(AttemptWrite {
            durability: Durability::Durable,
            lineage,
            serving: None,
        });
        if let Err(error) = write.await {
            tracing::error!(
                instance = %self.attempt.instance,
                attempt = %self.attempt.name,
                error = %reason_of(&error),
                "the attempt's outcome could not be journaled; it is reported, but not kept for a retry of the report"
            );
        }
        crate::failpoint!(self.crash_scope(), "after_finish");
    }
}

/// A phase the journal could not record; the attempt goes on.
fn log_unjournaled(instance: &crate::gate::InstanceKey, attempt: &str, error: &StepError) {
    tracing::error!(
        %instance,
        attempt,
        error = %reason_of(error),
        "the intent journal could not record a phase; the attempt goes on"
    );
}

fn millis_since_epoch(at: SystemTime) -> i64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_else(|_| unix_millis_now())
}

/// The fresh cgroup, the gate right before the exec, the exec, and the
/// check that what started is what the attempt chose. An error after the
/// exec stops what started before it returns.
async fn spawn_successor(
    ctx: Ctx<'_>,
    successor: &GenerationRecord,
    staged: &Staged,
    tier: &Tier,
    log_shim: LogShimStart,
    beside_serving: bool,
) -> Result<Running, StepError> {
    let key = &ctx.attempt.instance;
    let instance = ctx.engine.cgroups.instance(key)?;
    let cgroup = instance.create_generation(successor.n, tier).await?;
    let prepared = parts::prepare_run_dir(&ctx.engine.layout, key, &ctx.attempt.spec.process)
        .and_then(|run_dir| ctx.check_gate(GatePoint::Exec).map(|()| run_dir));
    let run_dir = match prepared {
        Ok(run_dir) => run_dir,
        Err(error) => {
            parts::remove_cgroup(&cgroup);
            return Err(error);
        }
    };
    let output = match log_shim.await {
        Ok(Ok(output)) => Some(output),
        Err(join) => {
            tracing::warn!(instance = %key, error = %join, "starting the log shim panicked; the generation's output is discarded");
            None
        }
        Ok(Err(error)) => {
            tracing::warn!(
                instance = %key,
                generation = successor.n,
                error = %reason_of(&error),
                "no log for this generation: its output is discarded"
            );
            None
        }
    };
    let specs = &ctx.attempt.spec.listeners;
    let listeners = if beside_serving {
        match ctx
            .engine
            .listeners
            .activated_beside(key, specs, successor.n)
        {
            Ok(listeners) => listeners,
            Err(error) => {
                parts::remove_cgroup(&cgroup);
                return Err(StepError::Listener(error));
            }
        }
    } else {
        ctx.engine.listeners.activated(key, specs)
    };
    let notify = match parts::bind_notify(ctx.engine, key, &ctx.attempt.spec, successor.n, &cgroup)
    {
        Ok(notify) => notify,
        Err(error) => {
            parts::remove_cgroup(&cgroup);
            return Err(error);
        }
    };
    let managed = parts::managed_dirs(ctx.engine, key, &ctx.attempt.spec.process);
    if let Err(error) = parts::ensure_managed_dirs(&managed, &ctx.attempt.spec.process) {
        parts::remove_cgroup(&cgroup);
        return Err(error);
    }
    let child = match parts::spawn(
        &ctx.attempt.spec,
        successor,
        staged,
        &cgroup,
        &run_dir,
        ctx.engine.config.allow_root,
        parts::Handed {
            output,
            listeners,
            notify_socket: notify.as_ref().map(|n| n.path().to_path_buf()),
            managed,
        },
    )
    .await
    {
        Ok(child) => child,
        Err(error) => {
            if !parts::may_have_run(&error) {
                parts::remove_cgroup(&cgroup);
                if let Err(error) =
                    crate::confine::filesystem::remove_private_dir(&successor.socket)
                {
                    tracing::warn!(instance = %key, generation = successor.n, %error, "the private directory of a generation that did not start could not be removed");
                }
            }
            return Err(error);
        }
    };
    let mut running = Running {
        record: successor.clone(),
        cgroup,
        tier: *tier,
        kind: ctx.attempt.spec.kind,
        process: Process::Spawned(Box::new(child)),
        notify,
        liveness: None,
        liveness_task: None,
        pre_stop: None,
        pid_file: super::lifecycle::pid_file_of(&ctx.attempt.spec),
        sidecars: None,
    };
    if let Err(error) = parts::verify_identity(&mut running, staged).await {
        if let Err((_, stop_error)) = parts::stop_generation(running, &ctx.attempt.spec.stop).await
        {
            tracing::error!(
                instance = %key,
                error = %reason_of(&stop_error),
                "a successor that is not what the attempt chose could not be proven stopped"
            );
        }
        return Err(error);
    }
    // Only what is proven the attempt's own gets its hook.
    running.pre_stop = super::lifecycle::PreStop::of(ctx.engine, key, &ctx.attempt.spec, &running);
    Ok(running)
}

/// Starts generation `n`'s log shim on a blocking thread (a fork, an exec
/// and a wait for its ready byte).
fn log_shim_start(ctx: Ctx<'_>, n: u64) -> LogShimStart {
    let key = ctx.attempt.instance.clone();
    let serving = ctx.engine.serving(&key).map(|s| s.generation);
    let logs = ctx.engine.logs.clone();
    tokio::task::spawn_blocking(move || logs.start(&key, n, serving))
}

/// How the health step ended well.
enum HealthEnd {
    Healthy,
    /// A worker exited 0 before it was ever healthy: a one-shot's success.
    CleanExit,
}

/// The successor's health probe, racing its exit: a successor that exits
/// is not waited for until the deadline.
async fn healthy_or_exit(
    running: &mut Running,
    probe: Result<Probe, ProbeError>,
    timeout: Duration,
    worker: bool,
) -> Result<HealthEnd, StepError> {
    let probe = probe.map_err(|e| StepError::Unhealthy(HealthError::Invalid(e)))?;
    let (n, cgroup) = (running.record.n, running.cgroup.clone());
    // systemd's Type=forking: probing starts once the start handed over,
    // for what is left of the window.
    let mut left = timeout;
    if let Some(pid_file) = running.pid_file.take() {
        let deadline = tokio::time::Instant::now() + timeout;
        super::lifecycle::hand_over(running, &pid_file, deadline).await?;
        left = deadline.saturating_duration_since(tokio::time::Instant::now());
    }
    const WHEN: &str = "before it was healthy";
    tokio::select! {
        result = parts::wait_healthy(&probe, left) => result.map(|()| HealthEnd::Healthy),
        status = parts::exited(running, WHEN) => exit_verdict(n, &cgroup, status, worker, WHEN)
            .map(|()| HealthEnd::CleanExit),
    }
}

/// How the settle window ended well.
enum SettleEnd {
    Survived,
    CleanExit,
}

/// The settle window: an exit inside it fails the attempt, except a
/// worker's exit 0 (a one-shot's success).
async fn settle(
    running: &mut Running,
    window: Duration,
    worker: bool,
) -> Result<SettleEnd, StepError> {
    let (n, cgroup) = (running.record.n, running.cgroup.clone());
    const WHEN: &str = "inside the settle window";
    tokio::select! {
        () = tokio::time::sleep(window) => Ok(SettleEnd::Survived),
        status = parts::exited(running, WHEN) => exit_verdict(n, &cgroup, status, worker, WHEN)
            .map(|()| SettleEnd::CleanExit),
    }
}

/// `Ok` only for a worker's exit 0; any other exit is the build's failure.
fn exit_verdict(
    generation: u64,
    cgroup: &crate::cgroup::Cgroup,
    status: Result<ExitStatus, StepError>,
    worker: bool,
    when: &'static str,
) -> Result<(), StepError> {
    let status = status?;
    if worker && status.success() {
        return Ok(());
    }
    if status.success()
        && let Ok(pids) = cgroup.pids()
        && !pids.is_empty()
    {
        return Err(StepError::Daemonized {
            generation,
            when,
            pids,
        });
    }
    Err(StepError::Exited {
        generation,
        when,
        status,
        oom_killed: cgroup.oom_killed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_outcomes_map_to_attempt_outcomes() {
        assert_eq!(outcome_of(StepOutcome::Ok, false), Outcome::Done);
        assert_eq!(outcome_of(StepOutcome::Cancelled, true), Outcome::Abandoned);
        assert_eq!(outcome_of(StepOutcome::Stale, true), Outcome::Abandoned);
        assert_eq!(outcome_of(StepOutcome::Failed, false), Outcome::Failed);
        assert_eq!(outcome_of(StepOutcome::Failed, true), Outcome::Down);
    }

    #[test]
    fn reasons_say_each_source_once() {
        let inner = std::io::Error::other("disk full");
        let error = StepError::Journal(crate::journal::JournalError::Write {
            path: "/state/journal/a.b.json".into(),
            source: inner,
        });
        let reason = reason_of(&error);
        assert_eq!(reason.matches("disk full").count(), 1, "{reason}");
        assert!(reason.contains("/state/journal/a.b.json"), "{reason}");
    }
}
