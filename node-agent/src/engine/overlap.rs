//! Overlap (SPEC 5.5): the successor starts beside the incumbent and takes
//! over `current.sock` only once it is healthy (and settled); then the
//! incumbent retires with proof of exit. Before the switch, every failure
//! stops the successor and leaves the incumbent serving.

use std::time::Instant;

use super::flow::{Ended, Finished, Run, Started, reason_of};
use super::parts::{self, Staged};
use super::sidecars::Sidecars;
use super::types::Step;
use super::{Claim, Running};
use crate::cgroup::{ParentRaise, Tier};
use crate::classify::{StepError, StepOutcome};
use crate::gate::GatePoint;
use crate::journal::{Durability, Phase, unix_millis_now};

/// Runs an overlap from staging to the retirement. With no serving
/// generation (an install) there is nothing to raise or retire.
pub(super) async fn run(run: &mut Run<'_>, claim: &mut Claim<'_>) -> Result<Finished, Ended> {
    let ctx = run.ctx();
    let staged = run
        .step(
            Step::Stage,
            true,
            parts::stage(&ctx.engine.stager, &ctx.attempt.spec.build),
        )
        .await?;
    crate::failpoint!(run.crash_scope(), "staged");
    let started = Instant::now();
    let admitted = run.admit(claim.serving.as_ref(), &staged).await;
    let tier = run.note(Step::Admit, started, admitted)?;
    crate::failpoint!(run.crash_scope(), "after_admit");

    let mut raise = None;
    let result = after_admission(run, claim, &staged, &tier, &mut raise).await;
    // Every exit path restores a raised parent, after the extra generation
    // has left (the successor stopped on a failure, the incumbent retired
    // on success): lowering limits under two live generations could make
    // the kernel reclaim or OOM-kill inside the instance.
    let restore_note = restore_parent(run, raise);
    match result {
        Ok(mut finished) => {
            if let Some(note) = restore_note {
                append(&mut finished.note, &note);
            }
            if let Err(error) = set_instance_tier(run, &tier) {
                append(&mut finished.note, &reason_of(&error));
            }
            Ok(finished)
        }
        Err(ended) => Err(ended),
    }
}

async fn after_admission(
    run: &mut Run<'_>,
    claim: &mut Claim<'_>,
    staged: &Staged,
    tier: &Tier,
    raise: &mut Option<ParentRaise>,
) -> Result<Finished, Ended> {
    let started = Instant::now();
    let raised = match claim.serving.as_ref() {
        Some(incumbent) => raise_parent(run, &incumbent.tier, tier, raise).await,
        // An install: the instance cgroup takes the tier before anything runs.
        None => set_instance_tier(run, tier),
    };
    run.note(Step::Raise, started, raised)?;
    crate::failpoint!(run.crash_scope(), "after_raise");

    run.start_log_shim();
    // The one durable intent before the exec (SPEC 5.5 step 4).
    run.record.advance(Phase::Spawning);
    let write = run.write_journal(Durability::Durable);
    run.step(Step::Journal, false, write).await?;
    crate::failpoint!(run.crash_scope(), "after_journal");

    run.beside_serving = claim.serving.is_some();
    let mut successor = match run.start_successor(staged, tier).await? {
        Started::Serving(running) => *running,
        // Only workers exit cleanly on purpose, and workers never overlap.
        Started::CleanExit => {
            return Err(Ended {
                outcome: StepOutcome::Failed,
                error: StepError::Internal("a server's successor exited before the switch"),
            });
        }
    };

    let started = Instant::now();
    let incumbent_socket = claim.serving.as_ref().map(|s| s.record.socket.clone());
    let switched = switch(run, &mut successor, incumbent_socket.as_deref()).await;
    if let Err(error) = switched {
        let ended = run.note(Step::Switch, started, Err::<(), _>(error));
        run.clean_up(successor).await;
        return ended.map(|()| Finished::default());
    }
    run.note(Step::Switch, started, Ok(()))?;
    successor.sidecars = Sidecars::start(
        run.engine,
        &run.attempt.instance,
        &run.attempt.spec,
        &successor,
    );
    let retiring = claim.serving.replace(successor);
    claim.publish();

    let mut finished = Finished::default();
    if let Some(retiring) = retiring {
        // Carries the new serving generation too.
        run.advance_after_exec(Phase::IncumbentStopped).await;
        crate::failpoint!(run.crash_scope(), "before_retire");
        let started = Instant::now();
        let stop = run.attempt.spec.stop.clone();
        let n = retiring.record.n;
        let mut retiring = retiring;
        if let Some(how) = parts::exited_before_stop(&mut retiring) {
            append(
                &mut finished.note,
                &format!("generation {n} had already exited ({how}) before it was retired"),
            );
        }
        let stopped = parts::stop_generation(retiring, &stop).await;
        match stopped {
            Ok(report) => {
                crate::failpoint!(run.crash_scope(), "after_retire");
                run.drain = Some(report.drain);
                if report.killed {
                    append(
                        &mut finished.note,
                        &format!(
                            "generation {n} did not stop within {}s of the stop signal; its cgroup was killed",
                            stop.timeout_seconds
                        ),
                    );
                }
                let _ = run.note(Step::Retire, started, Ok(()));
            }
            Err((_, error)) => {
                append(
                    &mut finished.note,
                    &format!(
                        "the retiring generation {n} is not proven stopped; its cgroup is left for recovery: {}",
                        reason_of(&error)
                    ),
                );
                let _ = run.note(Step::Retire, started, Err::<(), _>(StepError::Stop(error)));
            }
        }
    }
    Ok(finished)
}

/// The parent raise: its previous values go to the journal before the
/// first write, so every exit path (and recovery) can put them back.
async fn raise_parent(
    run: &mut Run<'_>,
    incumbent: &Tier,
    successor: &Tier,
    raise: &mut Option<ParentRaise>,
) -> Result<(), StepError> {
    let key = &run.attempt.instance;
    let instance = run.engine.cgroups.instance(key)?;
    let prepared = instance.begin_raise(incumbent, successor)?;
    if prepared.is_noop() {
        return Ok(());
    }
    run.record.advance(Phase::ParentRaised {
        saved: parts::saved_limits(prepared.record()),
    });
    // Ordered: a node crash takes the raised cgroup with it.
    run.write_journal(Durability::Ordered).await?;
    let applying = raise.insert(prepared);
    applying.apply()?;
    Ok(())
}

/// Writes the tier as the instance cgroup's own limits.
fn set_instance_tier(run: &Run<'_>, tier: &Tier) -> Result<(), StepError> {
    let key = &run.attempt.instance;
    let instance = run.engine.cgroups.instance(key)?;
    instance.apply_tier(tier)?;
    Ok(())
}

/// Puts a raised parent back; returns a note for the reason when it could
/// not (the journal keeps what to restore for recovery).
fn restore_parent(run: &mut Run<'_>, raise: Option<ParentRaise>) -> Option<String> {
    let mut raise = raise?;
    match raise.restore() {
        Ok(()) => {
            run.record.parent_restored();
            None
        }
        Err(error) => {
            // The journal keeps the saved values: recovery restores them.
            let _ = raise.disarm();
            Some(format!(
                "the instance cgroup's raised limits could not be restored: {}",
                reason_of(&error)
            ))
        }
    }
}

/// SPEC 5.5 step 8: the gate again, the successor still alive, then
/// `current.sock` repointed and the steered listeners switched (SPEC 6.3).
/// If the link cannot move, nothing switched; if a listener cannot, the
/// link goes back to the incumbent and nothing switched either.
/// No journal write comes first: recovery reads where the link points
/// (and steers the listeners of the generation it finds there), and the
/// link's rename is durable on its own. The new serving generation goes
/// to the journal with the next write.
async fn switch(
    run: &mut Run<'_>,
    successor: &mut Running,
    incumbent_socket: Option<&std::path::Path>,
) -> Result<(), StepError> {
    run.ctx().check_gate(GatePoint::Switch)?;
    if let Some(status) = parts::has_exited(successor) {
        return Err(StepError::Exited {
            generation: successor.record.n,
            when: "before the switch",
            status,
            oom_killed: successor.cgroup.oom_killed(),
        });
    }
    run.record.advance(Phase::Switched);
    crate::failpoint!(run.crash_scope(), "before_switch");
    let instance_dir = run.engine.layout.instance_dir(&run.attempt.instance);
    parts::switch_current(run.attempt, &instance_dir, &successor.record.socket)?;
    crate::failpoint!(run.crash_scope(), "after_link_switch");
    let key = &run.attempt.instance;
    if let Err(error) = run
        .engine
        .listeners
        .switch_to(key, successor.record.n)
        .await
    {
        if let Some(incumbent) = incumbent_socket
            && let Err(back) = parts::switch_current(run.attempt, &instance_dir, incumbent)
        {
            tracing::error!(instance = %key, error = %reason_of(&back), "current.sock could not be put back to the incumbent after its listeners would not switch");
        }
        return Err(StepError::Listener(error));
    }
    crate::failpoint!(run.crash_scope(), "after_switch");
    successor.record.serving_since_ms = Some(unix_millis_now());
    run.serving_now = Some(Some(successor.record.clone()));
    Ok(())
}

/// Adds `note` to a reason, `; `-separated.
pub(super) fn append(reason: &mut String, note: &str) {
    if !reason.is_empty() {
        reason.push_str("; ");
    }
    reason.push_str(note);
}
