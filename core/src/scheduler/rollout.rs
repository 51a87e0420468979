//! Which nodes get an attempt now: drift, cause, the canary cohort,
//! `maxParallel`, supersession, holds, the retry allowance and the backoff
//! of abandoned attempts; and which old attempts go.

use std::collections::BTreeMap;
use std::time::Duration;

use genswap_crds::{
    AnalysisPhase, Cause, Demand, DesiredState, HistoryEntry, InstanceKind, Mode, NodeGeneration,
    NodeSelector, OnFailure, Outcome, SocketLayout, SwapAttempt, SwapAttemptSpec,
};
use k8s_openapi::api::core::v1::Node;

use super::analysis::{self, Gate};
use super::failure_book::FailureBook;
use super::supervision::Down;
use super::{ABANDONED_RUN_KEPT, Context, NodeSlot};

/// The first re-issue of an abandoned attempt waits this long.
const BACKOFF_BASE: Duration = Duration::from_secs(5);
/// No re-issue waits longer.
const BACKOFF_CAP: Duration = Duration::from_secs(300);

/// Whether a node with `labels` matches `selector`: every selector pair is
/// among the labels. An empty selector matches every node.
pub fn selects(selector: &NodeSelector, labels: Option<&BTreeMap<String, String>>) -> bool {
    selector.iter().all(|(key, value)| {
        labels
            .and_then(|labels| labels.get(key))
            .is_some_and(|v| v == value)
    })
}

/// The mode an attempt will run in on the node (§5.2): an overlap runs as a
/// hold for a fixed socket, a hold demand, or a worker (workers always stop
/// then start).
pub fn effective_mode(
    mode: Mode,
    demand: Demand,
    layout: SocketLayout,
    kind: InstanceKind,
) -> Mode {
    if mode == Mode::Hold
        || demand == Demand::Hold
        || layout == SocketLayout::Fixed
        || kind == InstanceKind::Worker
    {
        Mode::Hold
    } else {
        Mode::Overlap
    }
}

/// The mode an issued attempt runs in, when the agent did not say.
pub(super) fn effective_mode_of(spec: &SwapAttemptSpec) -> Mode {
    effective_mode(spec.mode, spec.demand, spec.socket.layout, spec.kind)
}

/// How long to wait before re-issuing after `consecutive` abandoned attempts
/// of the same desired state on a node: 5 s, 10 s, 20 s, ... capped at 5 min.
pub fn abandoned_backoff(consecutive: usize) -> Duration {
    if consecutive == 0 {
        return Duration::ZERO;
    }
    let doublings = u32::try_from(consecutive - 1).unwrap_or(u32::MAX).min(16);
    BACKOFF_BASE.saturating_mul(1 << doublings).min(BACKOFF_CAP)
}

/// The nodes `selector` picks, sorted by name (the rollout order), each
/// with its value of `label`.
pub(super) fn select_nodes<'a>(
    selector: &NodeSelector,
    nodes: &'a [Node],
    label: Option<&str>,
) -> Vec<(&'a str, Option<&'a str>)> {
    let mut selected: Vec<(&str, Option<&str>)> = nodes
        .iter()
        .filter(|node| selects(selector, node.metadata.labels.as_ref()))
        .filter_map(|node| {
            let value = label.and_then(|label| {
                node.metadata
                    .labels
                    .as_ref()
                    .and_then(|labels| labels.get(label))
                    .map(String::as_str)
            });
            Some((node.metadata.name.as_deref()?, value))
        })
        .collect();
    selected.sort_unstable_by_key(|(name, _)| *name);
    selected.dedup_by_key(|(name, _)| *name);
    selected
}

/// One attempt to create.
pub(super) struct Issue {
    /// Index into the slots.
    pub slot: usize,
    pub cause: Cause,
    /// Toward the restore target ([`Context::good`]), not the desired state.
    pub restore: bool,
}

/// Where the rollout stands after this plan, for the status.
#[derive(Default)]
pub(super) struct Progress<'a> {
    pub selected: usize,
    /// Nodes that serve the desired state.
    pub ready: usize,
    pub not_ready: Vec<&'a str>,
    /// Nodes with an attempt in flight once this plan's attempts exist.
    pub in_flight: usize,
    /// Nodes waiting for the canaries, `maxParallel` or a backoff.
    pub waiting: usize,
    /// Attempts for an older desired state are being replaced or still run.
    pub superseding: bool,
    /// An abandoned attempt is being re-issued or waits for its backoff.
    pub retrying_abandoned: bool,
    /// A retry allowance of the held-down desired build is in use.
    pub retrying_held: bool,
    /// Nodes the failure book stops, with no retry armed: a human must act.
    pub stalled: Vec<&'a str>,
    /// Stalled nodes where nothing serves after a `down`.
    pub down: Vec<&'a str>,
    /// Nodes that run the desired state but are down between attempts.
    pub down_between: Vec<(&'a str, Down)>,
    /// Of those, the nodes whose generation the agent stopped because its
    /// liveness probe failed.
    pub liveness_failed: Vec<&'a str>,
    /// Nodes whose last attempts were all refused for the same reason.
    pub refused: Vec<(&'a str, String)>,
    /// Attempts `rollout.paused` withheld from this plan.
    pub paused: usize,
    /// Ready nodes with a sidecar that is not running, and how each is.
    pub sidecars_down: Vec<(&'a str, String)>,
    /// Nodes with an attempt in flight once this plan's attempts exist.
    pub in_flight_nodes: Vec<&'a str>,
    /// The wave that goes now.
    pub position: Position,
    /// Seconds without progress, once past `rollout.progressDeadlineSeconds`.
    pub deadline_exceeded: Option<i64>,
    /// When the rollout last moved (ms since the epoch).
    pub last_progress: Option<i64>,
    /// The desired build staged ahead of its rollout; set by the plan.
    pub prestage: PrestageProgress<'a>,
}

/// Pre-staging as the conditions tell it (`prestage`).
#[derive(Default)]
pub(super) struct PrestageProgress<'a> {
    /// Attempts toward the desired build wait for it.
    pub closed: bool,
    pub staged: i64,
    pub needed: i64,
    /// Nodes that cannot stage it, with why.
    pub failing: Vec<(&'a str, String)>,
    /// Seconds since it began, once past its deadline.
    pub deadline_exceeded: Option<i64>,
}

/// Where the waves stand.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Position {
    /// The wave whose nodes go now, or that bakes; `None` once all are done.
    pub wave: Option<usize>,
    /// When the baking wave's bake ends (ms since the epoch).
    pub baking_until: Option<i64>,
    /// The finished wave's analysis, while it holds the next wave back.
    pub analysis: Option<Gate>,
}

pub(super) struct Decisions<'a> {
    /// In node order, which is also revision order.
    pub issues: Vec<Issue>,
    pub requeue_after: Option<Duration>,
    pub progress: Progress<'a>,
}

/// What `decide` needs to know about one node.
struct Facts {
    serves: bool,
    /// The newest attempt has no outcome yet.
    in_flight: bool,
    /// The newest attempt carries the desired tuple.
    aims: bool,
    held: bool,
    /// Milliseconds since the epoch before which an abandoned attempt of
    /// the desired state is not re-issued.
    backoff_until: Option<i64>,
    /// The reason the last [`REFUSALS_TO_STALL`] attempts of the desired
    /// state were all abandoned with.
    refused: Option<String>,
}

impl Facts {
    fn of(slot: &NodeSlot<'_>, ctx: &Context<'_>, book: &FailureBook) -> Self {
        let desired = &ctx.desired;
        let newest = slot.attempts.last();
        let outcome = newest
            .and_then(|a| a.status.as_ref())
            .and_then(|s| s.outcome);
        let aims = newest.is_some_and(|a| aims_at(&a.spec, desired));
        let in_flight = newest.is_some() && outcome.is_none();
        let abandoned = aims && outcome == Some(Outcome::Abandoned);
        let backoff_until = abandoned
            .then(|| backoff_until(slot.attempts, desired))
            .flatten();
        let refused = abandoned
            .then(|| repeated_refusal(slot.attempts, desired))
            .flatten();
        Self {
            serves: serves(&slot.entry, desired),
            in_flight,
            aims,
            held: book.blocks(&desired.build, ctx.mode, slot.name, ctx.halt),
            backoff_until,
            refused,
        }
    }
}

/// Which wave goes now: the first that is not finished, or that finished
/// and bakes while a later one waits. A wave is finished when each of its
/// nodes serves the desired state, or (without haltOnFailure, where a held
/// node no longer holds the rest back) is held down.
fn position(
    ctx: &Context<'_>,
    slots: &[NodeSlot<'_>],
    facts: &[Facts],
    wave_count: usize,
    now_ms: i64,
) -> Position {
    // A failed or inconclusive analysis halts the rollout at the wave it
    // judged, whatever its nodes do since (a restore takes them off it).
    if let Some(record) = ctx.analysis
        && matches!(
            record.phase,
            AnalysisPhase::Failed | AnalysisPhase::Inconclusive
        )
    {
        return Position {
            wave: usize::try_from(record.wave_index).ok(),
            baking_until: None,
            analysis: Some(Gate::Halted(record.phase)),
        };
    }
    let mut finished = vec![true; wave_count];
    let mut finished_at: Vec<Option<i64>> = vec![None; wave_count];
    for (slot, f) in slots.iter().zip(facts) {
        let Some(done) = finished.get_mut(slot.wave) else {
            continue;
        };
        if f.serves {
            // A record keeps whole seconds: the node took over at most a
            // second after its `since`, so the wave counts as done at the
            // end of that second, and no bake is cut short.
            let since = slot
                .entry
                .since
                .as_ref()
                .map(|since| since.0.as_millisecond().div_euclid(1000) * 1000 + 1000);
            let at = &mut finished_at[slot.wave];
            *at = (*at).max(since);
        } else if ctx.halt || !f.held {
            *done = false;
        }
    }
    let bake_ms = ctx.spec.rollout.bake_seconds.saturating_mul(1000);
    for wave in 0..wave_count {
        if !finished[wave] {
            return Position {
                wave: Some(wave),
                ..Position::default()
            };
        }
        let later_waits = finished[wave + 1..].iter().any(|done| !done);
        let Some(at) = finished_at[wave] else {
            continue;
        };
        let baking_until = Some(at.saturating_add(bake_ms))
            .filter(|until| later_waits && bake_ms > 0 && *until > now_ms);
        // Judged even when no wave waits (one node, standalone, the last
        // wave with everyWave): a failure there still halts and restores.
        if analysis::applies(ctx.spec, wave) {
            let gate = analysis::gate(ctx, wave, at);
            if gate != Gate::Open {
                return Position {
                    wave: Some(wave),
                    baking_until,
                    analysis: Some(gate),
                };
            }
        }
        if baking_until.is_some() {
            return Position {
                wave: Some(wave),
                baking_until,
                analysis: None,
            };
        }
    }
    Position::default()
}

/// Decides the attempts of this plan, in node order.
pub(super) fn decide<'a>(
    ctx: &Context<'_>,
    slots: &[NodeSlot<'a>],
    book: &FailureBook,
    wave_count: usize,
    prestaging: bool,
) -> Decisions<'a> {
    let desired = &ctx.desired;
    let now_ms = ctx.now.0.as_millisecond();
    let max_parallel = ctx.spec.rollout.parallel(slots.len());
    let facts: Vec<Facts> = slots.iter().map(|s| Facts::of(s, ctx, book)).collect();
    let position = position(ctx, slots, &facts, wave_count, now_ms);
    // The waves whose nodes may go: those up to the one that goes now, but
    // not past a wave that bakes.
    let open_through = position.wave.unwrap_or(usize::MAX);
    let retry_targets = retry_targets(ctx, slots, &facts, book);

    let analysis_halted = matches!(position.analysis, Some(Gate::Halted(_)));
    let analysis_failed = position.analysis == Some(Gate::Halted(AnalysisPhase::Failed));
    let restore = (ctx.spec.rollout.on_failure == OnFailure::Restore)
        .then(|| ctx.good.map(|good| RestoreTarget::new(good, ctx)))
        .flatten();
    let mut in_flight = facts.iter().filter(|f| f.in_flight).count();
    let mut issues = Vec::new();
    let measuring = match position.analysis {
        Some(Gate::Measuring { due }) => Some(due.max(now_ms)),
        _ => None,
    };
    let mut earliest_due: Option<i64> = match (position.baking_until, measuring) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let mut progress = Progress {
        selected: slots.len(),
        position,
        ..Progress::default()
    };

    for (index, (slot, f)) in slots.iter().zip(&facts).enumerate() {
        let pending_backoff = f.backoff_until.filter(|due| *due > now_ms);
        if analysis_failed && f.serves {
            progress.not_ready.push(slot.name);
            if let Some(restore) = restore.as_ref() {
                let step = restore.step(slot, book, now_ms);
                take_restore(step, index, &mut in_flight, &mut issues, &mut earliest_due);
            }
            continue;
        }
        if f.serves {
            match &slot.down {
                Some(down) => {
                    progress.not_ready.push(slot.name);
                    progress.down_between.push((slot.name, down.clone()));
                    if slot
                        .entry
                        .last_exit
                        .as_ref()
                        .is_some_and(|exit| exit.liveness_failed.is_some())
                    {
                        progress.liveness_failed.push(slot.name);
                    }
                }
                None => {
                    progress.ready += 1;
                    let down: Vec<String> = slot
                        .entry
                        .sidecars
                        .iter()
                        .filter(|s| !s.is_up())
                        .map(|s| s.describe())
                        .collect();
                    if !down.is_empty() {
                        progress.sidecars_down.push((slot.name, down.join(", ")));
                    }
                }
            }
            if f.in_flight && !f.aims {
                progress.superseding = true;
                // Take the node back to what it serves (a rollback while an
                // attempt moves it away). Never for a held build: that
                // attempt would be the held build's, not a restore.
                if !f.held {
                    issues.push(Issue {
                        slot: index,
                        cause: cause_for(&slot.entry, desired, ctx.spec.cause),
                        restore: false,
                    });
                }
            }
            continue;
        }
        progress.not_ready.push(slot.name);
        if f.in_flight && f.aims {
            continue;
        }
        if f.in_flight {
            progress.superseding = true;
        }
        if f.held {
            if !book.armed_for(&desired.build, ctx.mode, slot.name, ctx.halt) {
                progress.stalled.push(slot.name);
                if is_down(&slot.entry) {
                    progress.down.push(slot.name);
                }
                let failed_here = book.blocks(&desired.build, ctx.mode, slot.name, false);
                if let Some(restore) = restore.as_ref().filter(|_| failed_here) {
                    let step = restore.step(slot, book, now_ms);
                    take_restore(step, index, &mut in_flight, &mut issues, &mut earliest_due);
                }
                continue;
            }
            progress.retrying_held = true;
            if !retry_targets.contains(&index) {
                continue;
            }
            if let Some(due) = pending_backoff {
                progress.retrying_abandoned = true;
                progress.waiting += 1;
                earliest_due = Some(earliest_due.map_or(due, |e| e.min(due)));
                continue;
            }
            if !f.in_flight {
                in_flight += 1;
            }
            issues.push(Issue {
                slot: index,
                cause: Cause::Retry,
                restore: false,
            });
            continue;
        }
        if analysis_halted {
            // Nothing of the judged build starts until a new build or a
            // new spec.retry; a restore already begun is seen through (an
            // abandoned one is issued again after its backoff).
            if let Some(restore) = restore.as_ref().filter(|r| r.begun(slot)) {
                let step = restore.step(slot, book, now_ms);
                take_restore(step, index, &mut in_flight, &mut issues, &mut earliest_due);
            }
            continue;
        }
        if let Some(reason) = &f.refused {
            // Still retried with the backoff (a file may appear), but a
            // refusal that keeps coming back needs a human.
            progress.refused.push((slot.name, reason.clone()));
        }
        if let Some(due) = pending_backoff {
            progress.retrying_abandoned = true;
            progress.waiting += 1;
            earliest_due = Some(earliest_due.map_or(due, |e| e.min(due)));
            continue;
        }
        let others_in_flight = in_flight - usize::from(f.in_flight);
        let open = slot.wave <= open_through;
        let turn = slot.canary || (open && others_in_flight < max_parallel);
        if !turn {
            progress.waiting += 1;
            continue;
        }
        if f.backoff_until.is_some() {
            progress.retrying_abandoned = true;
        }
        if !f.in_flight {
            in_flight += 1;
        }
        issues.push(Issue {
            slot: index,
            cause: cause_for(&slot.entry, desired, ctx.spec.cause),
            restore: false,
        });
    }
    if prestaging {
        // Nothing that would fetch the desired build goes before every
        // node holds it; a restore, or a node that holds it already
        // (a config or restart change), may.
        let before = issues.len();
        issues.retain(|issue| issue.restore || super::prestage::holds(&slots[issue.slot], desired));
        let withheld = before - issues.len();
        if withheld > 0 {
            progress.waiting += withheld;
            in_flight = facts.iter().filter(|f| f.in_flight).count()
                + issues.iter().filter(|i| !facts[i.slot].in_flight).count();
        }
    }
    if ctx.spec.rollout.paused && !issues.is_empty() {
        progress.paused = issues.len();
        progress.waiting += issues.len();
        issues.clear();
        in_flight = facts.iter().filter(|f| f.in_flight).count();
    }
    progress.in_flight = in_flight;
    let mut issued = issues.iter().map(|issue| issue.slot).peekable();
    for (index, (slot, f)) in slots.iter().zip(&facts).enumerate() {
        if issued.next_if_eq(&index).is_some() || f.in_flight {
            progress.in_flight_nodes.push(slot.name);
        }
    }
    Decisions {
        issues,
        requeue_after: earliest_due
            .map(|due| Duration::from_millis(u64::try_from(due - now_ms).unwrap_or(0))),
        progress,
    }
}

/// `rollout.onFailure: restore`: the last desired state every node served,
/// which a node the desired build failed on gets back.
struct RestoreTarget {
    target: DesiredState,
    mode: Mode,
}

/// What a node to restore needs now.
enum Restore {
    Issue,
    /// An abandoned restore waits for its backoff (ms since the epoch).
    Wait(i64),
    /// It serves the target, one is in flight, or the target failed there too.
    Nothing,
}

impl RestoreTarget {
    fn new(good: &HistoryEntry, ctx: &Context<'_>) -> Self {
        Self {
            target: DesiredState {
                build: good.build.clone(),
                sha256: good.sha256.clone(),
                config_rev: good.config_rev.clone(),
                restart_id: good.restart_id.clone(),
                mode: ctx.desired.mode,
            },
            mode: ctx.mode,
        }
    }

    /// The node's newest attempt is a restore.
    fn begun(&self, slot: &NodeSlot<'_>) -> bool {
        slot.attempts
            .last()
            .is_some_and(|a| aims_at(&a.spec, &self.target))
    }

    fn step(&self, slot: &NodeSlot<'_>, book: &FailureBook, now_ms: i64) -> Restore {
        if serves(&slot.entry, &self.target)
            || book.blocks(&self.target.build, self.mode, slot.name, false)
        {
            return Restore::Nothing;
        }
        let newest = slot.attempts.last();
        let outcome = newest
            .and_then(|a| a.status.as_ref())
            .and_then(|s| s.outcome);
        if newest.is_some_and(|a| aims_at(&a.spec, &self.target)) {
            match outcome {
                None => return Restore::Nothing,
                Some(Outcome::Abandoned) => {
                    if let Some(due) =
                        backoff_until(slot.attempts, &self.target).filter(|due| *due > now_ms)
                    {
                        return Restore::Wait(due);
                    }
                }
                Some(_) => {}
            }
        }
        Restore::Issue
    }
}

/// Takes one node's restore step into the plan.
fn take_restore(
    step: Restore,
    slot: usize,
    in_flight: &mut usize,
    issues: &mut Vec<Issue>,
    earliest_due: &mut Option<i64>,
) {
    match step {
        Restore::Issue => {
            *in_flight += 1;
            issues.push(Issue {
                slot,
                cause: Cause::Rollback,
                restore: true,
            });
        }
        Restore::Wait(due) => *earliest_due = Some(earliest_due.map_or(due, |e| e.min(due))),
        Restore::Nothing => {}
    }
}

/// The nodes an armed retry allowance may go to now. Under haltOnFailure the
/// hold is one for every node, so the allowance is one attempt in all: on
/// the node that failed when it is still selected, else on the first node
/// that needs the build. Without haltOnFailure each armed node gets its own.
fn retry_targets(
    ctx: &Context<'_>,
    slots: &[NodeSlot<'_>],
    facts: &[Facts],
    book: &FailureBook,
) -> Vec<usize> {
    let desired = &ctx.desired;
    let armed: Vec<&str> = book
        .holds(&desired.build, ctx.mode)
        .filter(|e| e.retry_armed)
        .map(|e| e.node.as_str())
        .collect();
    if armed.is_empty() {
        return Vec::new();
    }
    let needs = |index: &usize| !facts[*index].serves;
    let position = |node: &str| slots.iter().position(|s| s.name == node);
    if !ctx.halt {
        return armed
            .into_iter()
            .filter_map(position)
            .filter(needs)
            .collect();
    }
    let running = (0..slots.len()).find(|&index| {
        let f = &facts[index];
        f.in_flight
            && f.aims
            && slots[index]
                .attempts
                .last()
                .is_some_and(|a| a.spec.cause == Cause::Retry)
    });
    let target = running
        .or_else(|| armed.into_iter().filter_map(position).find(needs))
        .or_else(|| (0..slots.len()).find(needs));
    target.into_iter().collect()
}

/// Whether the node serves the desired state (mode aside: see the module
/// docs of the scheduler).
fn serves(entry: &NodeGeneration, desired: &DesiredState) -> bool {
    entry.build.as_deref() == Some(desired.build.as_str())
        && entry.sha256.as_deref() == Some(desired.sha256.as_str())
        && entry.config_rev.as_deref().unwrap_or_default() == desired.config_rev
        && entry.restart_id.as_deref().unwrap_or_default() == desired.restart_id
}

/// Whether an attempt carries the desired tuple, mode included.
fn aims_at(spec: &SwapAttemptSpec, desired: &DesiredState) -> bool {
    spec.build.id == desired.build
        && spec.build.sha256 == desired.sha256
        && spec.config_rev == desired.config_rev
        && spec.restart_id == desired.restart_id
        && spec.mode == desired.mode
}

/// Nothing serves on the node after a `down`.
fn is_down(entry: &NodeGeneration) -> bool {
    entry.build.is_none()
        && entry
            .last_attempt
            .as_ref()
            .is_some_and(|l| l.outcome == Outcome::Down)
}

/// `install` for a node that never had a generation; `config` / `restart`
/// when only those changed on the same build; otherwise the spec's cause.
/// `retry` is kept for the armed allowance, so a spec asking for it gets
/// `release`.
fn cause_for(entry: &NodeGeneration, desired: &DesiredState, spec_cause: Cause) -> Cause {
    let spec_cause = if spec_cause == Cause::Retry {
        Cause::Release
    } else {
        spec_cause
    };
    if entry.generation.is_none() && entry.build.is_none() {
        return Cause::Install;
    }
    let same_build = entry.build.as_deref() == Some(desired.build.as_str())
        && entry.sha256.as_deref() == Some(desired.sha256.as_str());
    if !same_build {
        return spec_cause;
    }
    if entry.config_rev.as_deref().unwrap_or_default() != desired.config_rev {
        Cause::Config
    } else if entry.restart_id.as_deref().unwrap_or_default() != desired.restart_id {
        Cause::Restart
    } else {
        spec_cause
    }
}

/// When the newest abandoned attempt of the desired state may be re-issued:
/// its end (or creation) plus the backoff for the run of consecutive
/// abandoned attempts of that state. `None` when no time is known.
fn backoff_until(attempts: &[&SwapAttempt], desired: &DesiredState) -> Option<i64> {
    abandoned_run_backoff(attempts, |a| aims_at(&a.spec, desired))
}

/// When the newest of `attempts` may go again: its end (or creation) plus
/// the backoff for the trailing run of abandoned attempts that `counts`.
/// `None` when no time is known.
pub(super) fn abandoned_run_backoff(
    attempts: &[&SwapAttempt],
    counts: impl Fn(&SwapAttempt) -> bool,
) -> Option<i64> {
    let run = attempts
        .iter()
        .rev()
        .take_while(|a| {
            counts(a) && a.status.as_ref().and_then(|s| s.outcome) == Some(Outcome::Abandoned)
        })
        .count();
    let newest = attempts.last()?;
    let ended = newest
        .status
        .as_ref()
        .and_then(|s| s.finished_at.as_ref())
        .or(newest.metadata.creation_timestamp.as_ref())?;
    let wait = i64::try_from(abandoned_backoff(run).as_millis()).unwrap_or(i64::MAX);
    Some(ended.0.as_millisecond().saturating_add(wait))
}

/// How many attempts in a row abandoned with one reason make a node stalled.
pub const REFUSALS_TO_STALL: usize = 3;

/// The reason shared by the node's last [`REFUSALS_TO_STALL`] attempts of
/// the desired state when each was abandoned with it.
fn repeated_refusal(attempts: &[&SwapAttempt], desired: &DesiredState) -> Option<String> {
    let mut reasons = attempts.iter().rev().take(REFUSALS_TO_STALL).map(|a| {
        let status = a.status.as_ref()?;
        (aims_at(&a.spec, desired) && status.outcome == Some(Outcome::Abandoned))
            .then(|| status.reason.clone().unwrap_or_default())
    });
    let first = reasons.next()??;
    let mut count = 1;
    for reason in reasons {
        if reason.as_ref() != Some(&first) {
            return None;
        }
        count += 1;
    }
    (count == REFUSALS_TO_STALL && !first.is_empty()).then_some(first)
}

/// Attempts of a selected node that are no longer needed, oldest first,
/// once the cache shows the node's record: every finished attempt whose
/// outcome the record holds, and every unfinished one older than the
/// record's carrier (the agent has moved past it). Kept: the carrier; the
/// newest attempt when it failed, until a newer one is issued (its steps
/// and conditions explain the failure, which the record only names); and a
/// trailing run of abandoned attempts up to [`ABANDONED_RUN_KEPT`] (the
/// backoff counts them), unless `backoff_counts` is false: the failure
/// book stops the node, so no attempt will wait on them.
pub(super) fn expired(slot: &NodeSlot<'_>, backoff_counts: bool) -> Vec<String> {
    let Some((carrier, record)) = &slot.recorded else {
        return Vec::new();
    };
    let attempts = slot.attempts;
    let mark = record.node.last_attempt.as_ref().map_or(0, |l| l.sched_rev);
    let outcome = |a: &SwapAttempt| a.status.as_ref().and_then(|s| s.outcome);
    // The run is counted below the attempts still in flight: a re-issue of
    // an abandoned attempt must not take the run its backoff counts.
    let in_flight = attempts
        .iter()
        .rev()
        .take_while(|a| outcome(a).is_none())
        .count();
    let settled = &attempts[..attempts.len() - in_flight];
    let run = match settled.last() {
        Some(newest) if in_flight == 0 && outcome(newest) == Some(Outcome::Failed) => 1,
        // A node the failure book stops gets no attempt the run would
        // pace: a spent retry's abandoned attempt is history, not backoff.
        _ if !backoff_counts => 0,
        _ => settled
            .iter()
            .rev()
            .take_while(|a| outcome(a) == Some(Outcome::Abandoned))
            .count()
            .min(ABANDONED_RUN_KEPT),
    };
    settled[..settled.len() - run]
        .iter()
        .filter(|a| a.metadata.name != carrier.metadata.name)
        .filter(|a| {
            let rev = a.spec.sched_rev;
            match a.status.as_ref().and_then(|s| s.outcome) {
                Some(_) => rev <= mark,
                None => rev < carrier.spec.sched_rev,
            }
        })
        .filter_map(|a| a.metadata.name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_five_seconds_up_to_five_minutes() {
        let steps: Vec<u64> = (1..=8).map(|n| abandoned_backoff(n).as_secs()).collect();
        assert_eq!(steps, [5, 10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(abandoned_backoff(0), Duration::ZERO);
        assert_eq!(abandoned_backoff(usize::MAX), BACKOFF_CAP);
    }

    #[test]
    fn an_overlap_runs_as_a_hold_where_the_spec_says_so() {
        use InstanceKind::{Instance, Worker};
        use SocketLayout::{Fixed, PerGeneration};
        let cases = [
            (
                Mode::Overlap,
                Demand::None,
                PerGeneration,
                Instance,
                Mode::Overlap,
            ),
            (
                Mode::Hold,
                Demand::None,
                PerGeneration,
                Instance,
                Mode::Hold,
            ),
            (
                Mode::Overlap,
                Demand::Hold,
                PerGeneration,
                Instance,
                Mode::Hold,
            ),
            (Mode::Overlap, Demand::None, Fixed, Instance, Mode::Hold),
            (
                Mode::Overlap,
                Demand::None,
                PerGeneration,
                Worker,
                Mode::Hold,
            ),
        ];
        for (mode, demand, layout, kind, expected) in cases {
            assert_eq!(
                effective_mode(mode, demand, layout, kind),
                expected,
                "{mode:?} {demand:?} {layout:?} {kind:?}"
            );
        }
    }

    #[test]
    fn a_selector_is_a_subset_of_the_labels() {
        let labels = BTreeMap::from([
            ("pool".to_string(), "edge".to_string()),
            ("zone".to_string(), "a".to_string()),
        ]);
        let selector = |pairs: &[(&str, &str)]| -> NodeSelector {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(selects(&selector(&[]), None));
        assert!(selects(&selector(&[("pool", "edge")]), Some(&labels)));
        assert!(!selects(&selector(&[("pool", "core")]), Some(&labels)));
        assert!(!selects(
            &selector(&[("pool", "edge"), ("gpu", "yes")]),
            Some(&labels)
        ));
        assert!(!selects(&selector(&[("pool", "edge")]), None));
    }
}
