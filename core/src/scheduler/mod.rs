//! The scheduler: a pure function from what the API server holds to what the
//! controller should write. No client, no clock of its own.
//!
//! One call of [`plan`] does, in order:
//! 1. select the nodes (labels ⊇ `spec.nodeSelector`), sorted by name: that
//!    order is the rollout order and the order revisions are handed out in;
//! 2. read every outcome a node's record has not recorded yet into the node
//!    entries and the failure book ([`outcomes`]), with one Event each;
//! 3. notice a change of `spec.retry` and arm the held-down desired build;
//! 4. decide which nodes get an attempt now ([`rollout`]): drift, cause,
//!    canary cohort, waves and their bake ([`waves`]), `maxParallel`,
//!    supersession, holds, abandoned backoff;
//! 5. build those attempts with fresh revisions, pick old attempts to delete,
//!    write the node records that changed ([`records`]), and compute the
//!    status and its conditions ([`conditions`], [`listing`]).
//!
//! # Decisions a reader may look for
//! - A node *serves* the desired state when its build, sha256, configRev and
//!   restartID match. `mode` is how a node gets there, not what it runs: a
//!   mode-only change re-targets attempts still in flight and selects the
//!   failure-book entry that applies, but restarts no serving node.
//! - The failure book holds (build, mode, node) entries. With `haltOnFailure`
//!   any entry of the desired (build, mode) stops every node; without it an
//!   entry stops only its own node and the rollout goes on elsewhere.
//! - The last `spec.retry` seen is kept in `status.lastRetry`. A status
//!   without it records the current token and arms nothing, so a new object
//!   never retries by itself.
//! - Abandoned attempts are re-issued after `5s · 2^(n-1)` (capped at 5 min)
//!   for `n` consecutive abandoned attempts of the desired state on the node.
//!   `n` is counted from the attempts themselves, so a node's trailing run of
//!   abandoned attempts is kept (up to [`ABANDONED_RUN_KEPT`]).
//! - What the controller remembers of a node (what it serves, the newest
//!   outcome recorded, its entries of the failure book) is the node's
//!   record, an annotation on its newest finished attempt ([`records`]).
//!   The status holds counts and at most [`genswap_crds::NODES_LISTED`] entries
//!   ([`listing`]); at rest a node keeps one attempt.
//! - A selector that matches no node is `Ready=False NoMatchingNodes` but not
//!   `Stalled`: a pool scaled to zero is a normal state and a node joining
//!   resumes the rollout without anyone acting.
//! - `canaryNodes` and `maxParallel` may be percentages of the selected
//!   nodes, rounded up. After the canaries the nodes go in waves (one, or
//!   one per value of `rollout.waves.byLabel`), each finished and baked
//!   before the next; the wave is derived from labels and records, never
//!   stored. A rollout that has not moved for
//!   `rollout.progressDeadlineSeconds` is Stalled ([`deadline`]).
//! - `rollout.paused` withholds every new attempt, a restore of a
//!   superseded node included; outcomes are still read, attempts in flight
//!   finish, and `Reconciling` says `Paused` while nodes wait for it.

pub mod analysis;
mod conditions;
mod deadline;
mod failure_book;
mod history;
mod listing;
mod naming;
mod outcomes;
mod pacing;
mod prestage;
mod records;
mod revisions;
mod rollout;
mod supervision;
mod waves;

use std::borrow::Borrow;
use std::time::Duration;

use genswap_crds::{
    AnalysisStatus, Cause, ConditionType, DesiredState, HistoryEntry, InstanceGeneration,
    InstanceGenerationSpec, InstanceGenerationStatus, Mode, NodeGeneration, NodeRecord, Outcome,
    RolloutStatus, SwapAttempt,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

pub use analysis::{AnalysisRequest, Answer, RenderedQuery, Verdict, judge, measured};
pub use conditions::reasons;
pub use history::HISTORY_KEPT;
pub use naming::{
    LABEL_INBOX, LABEL_INSTANCE, LABEL_NODE, attempt_name, inbox_entry, inbox_name, label_value,
    parse_inbox_entry,
};
pub use revisions::{OwnReservation, Revisions};
pub use rollout::{abandoned_backoff, effective_mode, selects};

use failure_book::FailureBook;

/// How many consecutive abandoned attempts per node are kept at most: their
/// count is the backoff exponent, and 7 reaches the 5-minute cap. Otherwise
/// a node keeps only the attempt that carries its record
/// ([`genswap_crds::ANNOTATION_RECORD`]) and those in flight.
pub const ABANDONED_RUN_KEPT: usize = 7;

/// What the controller must write for one InstanceGeneration.
///
/// The adapter applies it in this order: write `status` (which carries the
/// reserved `schedRev`) with optimistic concurrency on the object's
/// resourceVersion; only if that write succeeds, create `create`; then delete
/// `delete` and record `events`. A revision is therefore never issued twice:
/// a failed create burns its revision instead of reusing it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// Attempts to create, complete objects (name, labels, ownerReference,
    /// spec), each with a revision above the status's previous `schedRev`.
    pub create: Vec<SwapAttempt>,
    /// Names of attempts to delete: finished ones whose outcome a node's
    /// record already holds, or on nodes no longer selected.
    pub delete: Vec<String>,
    /// Node records to write, each onto the node's newest finished attempt
    /// (annotation [`genswap_crds::ANNOTATION_RECORD`]): before the status, so an outcome
    /// is recorded before its Event goes out.
    pub records: Vec<RecordWrite>,
    /// The status to write. `status.sched_rev` is the newest revision
    /// reserved: every revision in `create`, and with [`Revisions::ahead`]
    /// one for each node still waiting its turn.
    pub status: InstanceGenerationStatus,
    /// The status only records progress while attempts are in flight: its
    /// write may be put off until their outcomes (`pacing`).
    pub status_may_wait: bool,
    /// Kubernetes Events to record on the InstanceGeneration. Those read
    /// from the attempts (an outcome, a restart) come again from every plan
    /// until a status write records what they report.
    pub events: Vec<PlanEvent>,
    /// When to look again even if nothing changes (abandoned-attempt backoff).
    pub requeue_after: Option<Duration>,
    /// A measurement of `rollout.analysis` due now: the adapter takes it,
    /// folds it in with [`measured`] and plans again.
    pub analysis: Option<AnalysisRequest>,
}

/// A node record to write onto an attempt.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordWrite {
    /// The attempt that carries it: the node's newest `done` or `down`
    /// attempt (the one whose generation serves, or whose failure left
    /// nothing serving), else its newest finished one.
    pub attempt: String,
    pub record: NodeRecord,
    /// The outcome this write records for the first time, for metrics.
    pub new_outcome: Option<(Outcome, Mode)>,
}

impl RecordWrite {
    /// Puts the record onto its carrier among `attempts`, as the
    /// Kubernetes adapter's annotation patch does on the API server (the
    /// standalone runner and the simulated clusters hold attempts in
    /// memory). False when no attempt of that name is there.
    pub fn write_onto(&self, attempts: &mut [SwapAttempt]) -> bool {
        let carrier = attempts
            .iter_mut()
            .find(|a| a.metadata.name.as_deref() == Some(self.attempt.as_str()));
        let Some(carrier) = carrier else {
            return false;
        };
        carrier.metadata.annotations.get_or_insert_default().insert(
            genswap_crds::ANNOTATION_RECORD.to_string(),
            self.record.to_annotation(),
        );
        true
    }
}

/// An Event the plan asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanEvent {
    /// `Normal` or `Warning`.
    pub warning: bool,
    /// CamelCase reason, e.g. `AttemptIssued`, `SwapDone`, `BuildFailed`.
    pub reason: String,
    pub message: String,
}

/// Plans one InstanceGeneration. `attempts` are the SwapAttempts it owns;
/// `nodes` are all Nodes (the scheduler applies the selector). Each plan
/// reserves exactly the revisions it issues.
pub fn plan<A: Borrow<SwapAttempt>>(
    ig: &InstanceGeneration,
    attempts: &[A],
    nodes: &[Node],
    now: Timestamp,
) -> Plan {
    plan_with(ig, attempts, nodes, now, Revisions::default())
}

/// [`plan`], handing out revisions as `revisions` says (`revisions`).
pub fn plan_with<A: Borrow<SwapAttempt>>(
    ig: &InstanceGeneration,
    attempts: &[A],
    nodes: &[Node],
    now: Timestamp,
    revisions: Revisions,
) -> Plan {
    let ctx = Context::new(ig, now);
    let previous = ig.status.as_ref();
    let mut status = previous.cloned().unwrap_or_default();
    let mut events = Vec::new();

    let waves_spec = ctx.spec.rollout.waves.as_ref();
    let selected = rollout::select_nodes(
        &ctx.spec.node_selector,
        nodes,
        waves_spec.map(|waves| waves.by_label.as_str()),
    );
    let values: Vec<Option<&str>> = selected.iter().map(|(_, value)| *value).collect();
    let selected: Vec<&str> = selected.into_iter().map(|(name, _)| name).collect();
    let waves = waves::assign(
        waves_spec,
        &values,
        ctx.spec.rollout.canaries(selected.len()),
    );
    let (sorted_attempts, stage_attempts, newest_rev) = sort_attempts(&ctx, attempts);
    let (mut slots, strays) = gather(
        &selected,
        &waves.of_node,
        &sorted_attempts,
        std::mem::take(&mut status.nodes),
    );

    let mut book = FailureBook::new(records::book_entries(
        &slots,
        std::mem::take(&mut status.held_down),
    ));
    for slot in &mut slots {
        outcomes::observe(slot, &mut book, &ctx, &mut events);
        slot.down = supervision::observe(slot, &mut events);
    }

    let retry_changed = failure_book::observe_retry_token(&mut status.last_retry, &ctx.spec.retry);
    if retry_changed {
        let armed = book.arm(&ctx.desired.build, ctx.mode);
        if armed > 0 {
            events.push(PlanEvent {
                warning: false,
                reason: "RetryArmed".into(),
                message: format!(
                    "spec.retry changed: build {} ({}) may be attempted once more",
                    ctx.desired.build,
                    ctx.mode.as_str()
                ),
            });
        }
    }

    let prestage = prestage::observe(&ctx, &slots, &stage_attempts, retry_changed);
    let mut decisions = rollout::decide(&ctx, &slots, &book, waves.names.len(), prestage.closed);
    decisions.progress.prestage = rollout::PrestageProgress {
        closed: prestage.closed,
        staged: prestage.status.as_ref().map_or(0, |p| p.staged),
        needed: prestage.status.as_ref().map_or(0, |p| p.needed),
        failing: prestage.failing.clone(),
        deadline_exceeded: prestage.deadline_exceeded,
    };

    let mut issuer = revisions::Issuer::new(revisions, status.sched_rev, newest_rev);
    let mut create = Vec::with_capacity(decisions.issues.len());
    for issue in &decisions.issues {
        let sched_rev = issuer.issue();
        let slot = &slots[issue.slot];
        let restore = ctx.good.filter(|_| issue.restore);
        events.push(PlanEvent {
            warning: false,
            reason: "AttemptIssued".into(),
            message: format!(
                "node {}: rev {sched_rev}, cause {}, mode {}, build {}{}",
                slot.name,
                issue.cause.as_str(),
                ctx.spec.mode.as_str(),
                restore.map_or(ctx.desired.build.as_str(), |good| good.build.as_str()),
                if slot.canary { ", canary" } else { "" },
            ),
        });
        create.push(naming::build_attempt(
            &ctx,
            slot.name,
            sched_rev,
            issue.cause,
            slot.canary,
            restore,
            false,
        ));
    }
    for &index in &prestage.issue {
        let sched_rev = issuer.issue();
        let slot = &slots[index];
        create.push(naming::build_attempt(
            &ctx,
            slot.name,
            sched_rev,
            Cause::Release,
            false,
            None,
            true,
        ));
    }
    if prestage.status.is_some()
        && previous
            .and_then(|status| status.rollout.as_ref())
            .and_then(|rollout| rollout.prestage.as_ref())
            .is_none_or(|before| before.build != ctx.desired.build)
    {
        events.push(PlanEvent {
            warning: false,
            reason: reasons::PRESTAGING.into(),
            message: format!(
                "every node that serves another build stages {} before its first swap (rollout.prestage)",
                ctx.desired.build
            ),
        });
    }
    if let Some(after) = prestage.deadline_exceeded {
        events.extend(newly_stalled(
            previous,
            reasons::PRESTAGE_DEADLINE_EXCEEDED,
            format!(
                "build {} is not staged on every node after {after} s (rollout.prestageDeadlineSeconds {})",
                ctx.desired.build, ctx.spec.rollout.prestage_deadline_seconds
            ),
        ));
    }

    let mut delete = strays;
    delete.extend(prestage.delete.iter().cloned());
    // `stalled` is in node order, as the slots are.
    let mut stalled = decisions.progress.stalled.iter().peekable();
    for slot in &slots {
        let held = stalled.next_if(|name| **name == slot.name).is_some();
        delete.extend(rollout::expired(slot, !held));
    }

    let (rollout_status, deadline) = deadline::observe(
        previous,
        &ctx,
        &decisions.progress,
        &waves.names,
        !create.is_empty(),
    );
    decisions.progress.deadline_exceeded = deadline.exceeded_after;
    decisions.progress.last_progress = deadline.last_progress;
    if let Some(after) = deadline.exceeded_after {
        events.extend(newly_stalled(
            previous,
            reasons::PROGRESS_DEADLINE_EXCEEDED,
            format!(
                "no progress toward build {} for {after} s (rollout.progressDeadlineSeconds {})",
                ctx.desired.build, ctx.spec.rollout.progress_deadline_seconds
            ),
        ));
    }
    let (analysis_record, analysis_request) =
        analysis_of(&ctx, &decisions.progress.position, &waves.names, &slots);
    status.rollout = Some(RolloutStatus {
        analysis: analysis_record,
        prestage: prestage.status.clone(),
        ..rollout_status
    });
    let progress = &decisions.progress;
    let (records, carried) = records::writes(&slots, book.entries());
    status.good_build = good_build(&slots).or(status.good_build);
    // A build is good once every node serves it and no analysis holds it.
    if progress.selected > 0
        && progress.ready == progress.selected
        && progress.position.analysis.is_none()
    {
        history::record(&mut status.history, ctx.spec, &ctx.now);
    }
    status.ready = Some(format!("{}/{}", progress.ready, progress.selected));
    status.listeners = genswap_crds::listeners_summary(&ctx.spec.listeners);
    status.sched_rev = issuer.sched_rev(progress.waiting);
    status.observed_generation = ctx.generation;
    status.desired = Some(ctx.desired.clone());
    conditions::write(&mut status.conditions, &ctx, progress, &book, &waves.names);
    let listing = listing::List::new(
        &slots,
        progress,
        book.into_entries(),
        &carried,
        prestage.staged,
    );
    listing.write(&mut status);
    let status_may_wait = pacing::status_may_wait(previous, &status, progress.in_flight, &events);

    Plan {
        create,
        delete,
        records,
        status,
        status_may_wait,
        events,
        requeue_after: [
            decisions.requeue_after,
            deadline.due_in,
            prestage.requeue_after,
        ]
        .into_iter()
        .flatten()
        .min(),
        analysis: analysis_request,
    }
}

/// A Warning Event of `reason`, unless the status before already said
/// `Stalled` for it: one Event per stall, not one per plan.
fn newly_stalled(
    previous: Option<&InstanceGenerationStatus>,
    reason: &str,
    message: String,
) -> Option<PlanEvent> {
    let said = previous.is_some_and(|status| {
        genswap_crds::conditions::true_reason(&status.conditions, ConditionType::Stalled)
            == Some(reason)
    });
    (!said).then(|| PlanEvent {
        warning: true,
        reason: reason.into(),
        message,
    })
}

/// The analysis record the status carries, and the measurement due now.
fn analysis_of(
    ctx: &Context<'_>,
    position: &rollout::Position,
    wave_names: &[String],
    slots: &[NodeSlot<'_>],
) -> (Option<AnalysisStatus>, Option<AnalysisRequest>) {
    let (Some(wave), Some(analysis::Gate::Measuring { due })) = (position.wave, position.analysis)
    else {
        return (ctx.analysis.cloned(), None);
    };
    let name = wave_names.get(wave).map_or("", String::as_str);
    let record = analysis::record_for(ctx, wave, name);
    let request = (due <= ctx.now.0.as_millisecond())
        .then(|| {
            let nodes: Vec<&str> = slots
                .iter()
                .filter(|slot| slot.wave == wave)
                .map(|slot| slot.name)
                .collect();
            analysis::request(ctx, &record, &nodes)
        })
        .flatten();
    (Some(record), request)
}

/// What every step needs to know about the InstanceGeneration being planned.
struct Context<'a> {
    name: &'a str,
    namespace: Option<&'a str>,
    uid: Option<&'a str>,
    generation: Option<i64>,
    spec: &'a InstanceGenerationSpec,
    desired: DesiredState,
    /// The mode the desired state will run in on a node (§5.2): the failure
    /// book is keyed by the mode that ran.
    mode: Mode,
    halt: bool,
    now: Time,
    /// The stored analysis that counts for the desired build.
    analysis: Option<&'a AnalysisStatus>,
    /// `status.rollout` as the previous plan wrote it.
    previous_rollout: Option<&'a RolloutStatus>,
    /// What `rollout.onFailure: restore` takes a node back to: the newest
    /// state every node served, when it is not the desired one.
    good: Option<&'a HistoryEntry>,
}

impl<'a> Context<'a> {
    fn new(ig: &'a InstanceGeneration, now: Timestamp) -> Self {
        let spec = &ig.spec;
        Self {
            name: ig.metadata.name.as_deref().unwrap_or_default(),
            namespace: ig.metadata.namespace.as_deref(),
            uid: ig.metadata.uid.as_deref(),
            generation: ig.metadata.generation,
            spec,
            desired: spec.desired(),
            mode: effective_mode(spec.mode, spec.demand, spec.socket.layout, spec.kind),
            halt: spec.rollout.halt_on_failure,
            now: Time(now),
            analysis: analysis::current(ig),
            previous_rollout: ig.status.as_ref().and_then(|s| s.rollout.as_ref()),
            good: ig
                .status
                .as_ref()
                .and_then(|status| status.history.first())
                .filter(|good| !history::is_desired(good, spec)),
        }
    }
}

/// One selected node: its place in the rollout, its attempts (oldest first)
/// and its record being rewritten.
struct NodeSlot<'a> {
    name: &'a str,
    canary: bool,
    /// Its wave: 0 for the canaries ([`waves`]).
    wave: usize,
    attempts: &'a [&'a SwapAttempt],
    /// The record as read, and the attempt that carries it.
    recorded: Option<(&'a SwapAttempt, NodeRecord)>,
    /// The newest outcome recorded before this plan (revision, outcome).
    last_before: Option<(i64, Outcome)>,
    entry: NodeGeneration,
    /// Runs the desired state but is down between attempts.
    down: Option<supervision::Down>,
}

/// This instance's swap attempts sorted by (node, revision), so each
/// node's are one run; its stage-only attempts ([`prestage`]), apart; and
/// the highest revision among all of them. Attempts of another instance
/// are not ours to count or delete.
fn sort_attempts<'a, A: Borrow<SwapAttempt>>(
    ctx: &Context<'_>,
    attempts: &'a [A],
) -> (Vec<&'a SwapAttempt>, Vec<&'a SwapAttempt>, i64) {
    let (stage, mut ours): (Vec<&SwapAttempt>, Vec<&SwapAttempt>) = attempts
        .iter()
        .map(Borrow::borrow)
        .filter(|a| a.spec.instance == ctx.name)
        .partition(|a| prestage::is_stage_only(a));
    ours.sort_unstable_by(|a, b| {
        (a.spec.node_name.as_str(), a.spec.sched_rev)
            .cmp(&(b.spec.node_name.as_str(), b.spec.sched_rev))
    });
    let newest_rev = ours
        .iter()
        .chain(&stage)
        .map(|a| a.spec.sched_rev)
        .max()
        .unwrap_or(0);
    (ours, stage, newest_rev)
}

/// Pairs each selected node with its attempts and its record by walking the
/// three name-sorted lists together (no per-node lookups: a plan for a
/// thousand nodes stays linear). A node's record is the one on its newest
/// attempt that carries one; a node without one falls back to its entry in
/// `status.nodes` (what a status written before records held, or a node
/// whose attempts are gone). Returns the slots and the names of attempts
/// on nodes no longer selected.
fn gather<'a>(
    selected: &[&'a str],
    wave_of_node: &[usize],
    sorted_attempts: &'a [&'a SwapAttempt],
    mut previous_entries: Vec<NodeGeneration>,
) -> (Vec<NodeSlot<'a>>, Vec<String>) {
    // The scheduler writes them sorted; anything else is sorted here.
    if !previous_entries.is_sorted_by(|a, b| a.name <= b.name) {
        previous_entries.sort_by(|a, b| a.name.cmp(&b.name));
    }
    let mut entries = previous_entries.into_iter().peekable();
    let mut groups = sorted_attempts
        .chunk_by(|a, b| a.spec.node_name == b.spec.node_name)
        .peekable();
    let mut strays: Vec<&SwapAttempt> = Vec::new();
    let mut slots = Vec::with_capacity(selected.len());
    for (index, &name) in selected.iter().enumerate() {
        // Entries of nodes no longer selected are dropped on the way.
        while entries.next_if(|e| e.name.as_str() < name).is_some() {}
        while let Some(group) = groups.next_if(|g| g[0].spec.node_name.as_str() < name) {
            strays.extend(group);
        }
        let listed = entries.next_if(|e| e.name == name);
        let attempts: &[&SwapAttempt] = groups
            .next_if(|g| g[0].spec.node_name == name)
            .unwrap_or_default();
        let recorded = attempts
            .iter()
            .rev()
            .find_map(|&attempt| NodeRecord::on(attempt, name).map(|record| (attempt, record)));
        let mut entry = match &recorded {
            Some((_, record)) => record.node.clone(),
            None => listed.unwrap_or_else(|| NodeGeneration::fresh(name)),
        };
        entry.attention = None;
        let last_before = entry
            .last_attempt
            .as_ref()
            .map(|last| (last.sched_rev, last.outcome));
        slots.push(NodeSlot {
            name,
            canary: wave_of_node.get(index) == Some(&0),
            wave: wave_of_node.get(index).copied().unwrap_or(0),
            attempts,
            recorded,
            last_before,
            entry,
            down: None,
        });
    }
    strays.extend(groups.flatten());
    let strays = strays
        .into_iter()
        .filter_map(|a| a.metadata.name.clone())
        .collect();
    (slots, strays)
}

/// The build every selected node serves, when they all serve the same one.
fn good_build(slots: &[NodeSlot<'_>]) -> Option<String> {
    let first = slots.first()?.entry.build.as_ref()?;
    slots
        .iter()
        .all(|s| s.entry.build.as_ref() == Some(first))
        .then(|| first.clone())
}

/// `text` cut to at most `max` bytes (on a character boundary), marked with
/// an ellipsis when cut: the agents' reasons are free text, and the status
/// must stay bounded.
fn cut(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
