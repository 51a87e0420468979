//! Hold and workers (SPEC 5.6): the incumbent stops, then the successor
//! starts; a gap in service. A build failure after the stop is `down`. A
//! worker's new build that exits 0 inside its window is a one-shot's
//! success: `done` with `clean_exit`, and nothing serves afterwards.

use std::time::Instant;

use super::Claim;
use super::flow::{Ended, Finished, Run, Started};
use super::overlap::append;
use super::parts;
use super::types::Step;
use crate::cgroup::Tier;
use crate::classify::StepError;
use crate::journal::{Durability, Phase, unix_millis_now};

/// Runs a hold (or a worker's stop-then-start) from staging to the switch.
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
    // Before the stop, so the gap in service does not wait for its exec.
    run.start_log_shim();

    // The intent, with the successor's number and paths, before the stop:
    // from here recovery knows the incumbent may be gone.
    run.record.advance(Phase::IncumbentStopped);
    let write = run.write_journal(Durability::Ordered);
    run.step(Step::Journal, false, write).await?;
    crate::failpoint!(run.crash_scope(), "before_stop");

    let mut note = String::new();
    if let Some(mut incumbent) = claim.serving.take() {
        let started = Instant::now();
        let stop = run.attempt.spec.stop.clone();
        let n = incumbent.record.n;
        if let Some(how) = parts::exited_before_stop(&mut incumbent) {
            append(
                &mut note,
                &format!("generation {n} had already exited ({how}) before it was stopped"),
            );
        }
        match parts::stop_generation(incumbent, &stop).await {
            Ok(report) => {
                crate::failpoint!(run.crash_scope(), "after_stop");
                run.incumbent_stopped = true;
                run.drain = Some(report.drain);
                if report.killed {
                    append(
                        &mut note,
                        &format!(
                            "generation {n} did not stop within {}s of the stop signal; its cgroup was killed",
                            stop.timeout_seconds
                        ),
                    );
                }
                claim.publish();
                // On file with the intent before the exec, next.
                run.serving_now = Some(None);
                run.note(Step::Stop, started, Ok(()))?;
            }
            Err((incumbent, error)) => {
                // Not proven stopped: it may still serve, and a successor
                // beside it could not bind a fixed socket. Nothing starts.
                claim.serving = Some(incumbent);
                run.note(Step::Stop, started, Err::<(), _>(StepError::Stop(error)))?;
            }
        }
    }

    let result = after_stop(run, claim, &staged, &tier).await;
    match result {
        Ok(mut finished) => {
            if !note.is_empty() {
                let mut reason = note;
                if !finished.note.is_empty() {
                    append(&mut reason, &finished.note);
                }
                finished.note = reason;
            }
            Ok(finished)
        }
        Err(ended) => {
            // Nothing serves: `current.sock` must not name a dead socket.
            if claim.serving.is_none() {
                parts::remove_current_link(&run.engine.layout, &run.attempt.instance);
            }
            Err(ended)
        }
    }
}

async fn after_stop(
    run: &mut Run<'_>,
    claim: &mut Claim<'_>,
    staged: &parts::Staged,
    tier: &Tier,
) -> Result<Finished, Ended> {
    let started = Instant::now();
    let key = &run.attempt.instance;
    let tiered = run
        .engine
        .cgroups
        .instance(key)
        .and_then(|instance| instance.apply_tier(tier))
        .map_err(StepError::from);
    run.note(Step::Raise, started, tiered)?;
    crate::failpoint!(run.crash_scope(), "after_raise");

    // The one durable intent before the exec (SPEC 5.5 step 4).
    run.record.advance(Phase::Spawning);
    let write = run.write_journal(Durability::Durable);
    run.step(Step::Journal, false, write).await?;
    crate::failpoint!(run.crash_scope(), "after_journal");

    match run.start_successor(staged, tier).await? {
        Started::CleanExit => {
            parts::remove_current_link(&run.engine.layout, &run.attempt.instance);
            run.serving_now = Some(None);
            Ok(Finished {
                clean_exit: true,
                note: String::new(),
            })
        }
        Started::Serving(successor) => {
            let mut successor = *successor;
            let started = Instant::now();
            // `healthy` on file already decides a recovery the same way.
            run.record.advance(Phase::Switched);
            crate::failpoint!(run.crash_scope(), "before_switch");
            let instance_dir = run.engine.layout.instance_dir(&run.attempt.instance);
            let switched =
                parts::switch_current(run.attempt, &instance_dir, &successor.record.socket);
            if let Err(error) = switched {
                let ended = run.note(Step::Switch, started, Err::<(), _>(StepError::from(error)));
                run.clean_up(successor).await;
                return ended.map(|()| Finished::default());
            }
            crate::failpoint!(run.crash_scope(), "after_switch");
            successor.record.serving_since_ms = Some(unix_millis_now());
            // With the outcome, durably.
            run.serving_now = Some(Some(successor.record.clone()));
            successor.sidecars = super::sidecars::Sidecars::start(
                run.engine,
                &run.attempt.instance,
                &run.attempt.spec,
                &successor,
            );
            claim.serving = Some(successor);
            claim.publish();
            run.note(Step::Switch, started, Ok(()))?;
            Ok(Finished::default())
        }
    }
}
