//! What the agents report between attempts (SPEC 5.10): the `serving`
//! block of each node's newest `done` attempt, read into the node entry
//! (`serving`, `restarts`, `lastExit`, the generation that runs now), with
//! one Event per exit and per restart.
//!
//! Like outcomes, each is read once: the entry keeps the last exit and the
//! restart count it recorded, so an exit is new when its generation or time
//! differs and a restart when the count grew. A node whose generation is
//! down is not ready, but it gets no attempt: the desired state is what it
//! runs, and the agent restarts it (or, under `Never`, a human acts).

use genswap_crds::{
    LastExit, Outcome, RestartPolicy, ServingState, ServingStatus, SidecarStatus, SwapAttempt,
};

use super::{NodeSlot, PlanEvent};

/// Why a node that runs the desired state does not serve it now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Down {
    /// Its generation exited; the agent restarts it now.
    Restarting(String),
    /// It exited again and again; the next restart waits for its backoff.
    BackingOff(String),
    /// It exited and the restart policy leaves it down: a human must act.
    Left(String),
}

impl Down {
    pub(super) fn message(&self) -> &str {
        match self {
            Down::Restarting(m) | Down::BackingOff(m) | Down::Left(m) => m,
        }
    }
}

/// The newest `done` attempt's block, unless a later attempt went `down`
/// (nothing of that lineage runs then).
fn newest_block<'a>(
    attempts: &[&'a SwapAttempt],
) -> Option<(&'a SwapAttempt, Option<&'a ServingStatus>)> {
    for attempt in attempts.iter().rev() {
        let Some(status) = attempt.status.as_ref() else {
            continue;
        };
        match status.outcome {
            Some(Outcome::Done) => return Some((attempt, status.serving.as_ref())),
            Some(Outcome::Down) => return None,
            _ => {}
        }
    }
    None
}

/// Reads the block into the node entry; returns why the node is down
/// between attempts, if it is.
pub(super) fn observe(slot: &mut NodeSlot<'_>, events: &mut Vec<PlanEvent>) -> Option<Down> {
    let node = slot.name;
    let entry = &mut slot.entry;
    let runs = entry.build.is_some();
    let Some((attempt, block)) = newest_block(slot.attempts).filter(|_| runs) else {
        entry.serving = runs.then_some(true);
        entry.sidecars.clear();
        return None;
    };
    let Some(block) = block else {
        // A fresh lineage: the attempt's own generation serves.
        entry.serving = Some(true);
        entry.restarts = Some(0);
        entry.last_exit = None;
        entry.sidecars.clear();
        return None;
    };
    observe_sidecars(node, &entry.sidecars, &block.sidecars, events);
    entry.sidecars = block.sidecars.clone();
    if let Some(exit) = &block.last_exit
        && !same_exit(entry.last_exit.as_ref(), exit)
    {
        events.push(PlanEvent {
            warning: true,
            reason: "GenerationExited".into(),
            message: format!(
                "node {node}: generation {} exited between attempts with {}",
                exit.generation,
                exit.describe()
            ),
        });
    }
    let recorded = entry.restarts.unwrap_or(0);
    if block.restarts > recorded && block.state == ServingState::Running {
        events.push(PlanEvent {
            warning: false,
            reason: "GenerationRestarted".into(),
            message: format!(
                "node {node}: restarted as generation {} (restart {})",
                block.generation, block.restarts
            ),
        });
    }
    entry.serving = Some(block.state == ServingState::Running);
    entry.restarts = Some(block.restarts);
    entry.last_exit = block.last_exit.clone();
    entry.generation = Some(block.generation);
    let message = || {
        block
            .message
            .clone()
            .unwrap_or_else(|| format!("generation {} is not running", block.generation))
    };
    match block.state {
        ServingState::Running => None,
        ServingState::BackOff => Some(Down::BackingOff(message())),
        ServingState::Exited => {
            let policy = RestartPolicy::effective(attempt.spec.restart_policy, attempt.spec.kind);
            let clean = block.last_exit.as_ref().is_some_and(LastExit::clean);
            if policy.restarts_after(clean) {
                Some(Down::Restarting(message()))
            } else if clean {
                // A clean exit the policy does not restart: the worker's
                // job is done.
                entry.serving = Some(false);
                None
            } else {
                Some(Down::Left(message()))
            }
        }
    }
}

/// One Event per sidecar that went down since the last plan.
fn observe_sidecars(
    node: &str,
    recorded: &[SidecarStatus],
    now: &[SidecarStatus],
    events: &mut Vec<PlanEvent>,
) {
    for sidecar in now.iter().filter(|s| !s.is_up()) {
        let was = recorded.iter().find(|r| r.name == sidecar.name);
        let new = was.is_none_or(|r| {
            r.is_up() || r.generation != sidecar.generation || r.restarts != sidecar.restarts
        });
        if new {
            events.push(PlanEvent {
                warning: true,
                reason: "SidecarDown".into(),
                message: format!(
                    "node {node}: sidecar {} of generation {}",
                    sidecar.describe(),
                    sidecar.generation
                ),
            });
        }
    }
}

fn same_exit(recorded: Option<&LastExit>, exit: &LastExit) -> bool {
    recorded.is_some_and(|r| r.generation == exit.generation && r.at == exit.at)
}
