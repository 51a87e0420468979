//! The scheduler: a pure function from what the API server holds to what the
//! controller should write. No client, no clock of its own.
//!
//! One call of [`plan`] does, in order:
//! 1. select the nodes (labels ⊇ `spec.nodeSelector`), sorted by name: that
//!    order is the rollout order and the order revisions are handed out in;
//! 2. read every outcome the status has not recorded yet into the node
//!    entries and the failure book ([`outcomes`]), with one Event each;
//! 3. notice a change of `spec.retry` and arm the held-down desired build;
//! 4. decide which nodes get an attempt now ([`rollout`]): drift, cause,
//!    canary cohort, `maxParallel`, supersession, holds, abandoned backoff;
//! 5. build those attempts with fresh revisions, pick old attempts to delete,
//!    and compute the status and its conditions ([`conditions`]).
//!
//! # Decisions a reader may look for
//! - A node *serves* the desired state when its build, sha256, configRev and
//!   restartID match. `mode` is how a node gets there, not what it runs: a
//!   mode-only change re-targets attempts still in flight and selects the
//!   failure-book entry that applies, but restarts no serving node.
//! - The failure book holds (build, mode, node) entries. With `haltOnFailure`
//!   any entry of the desired (build, mode) stops every node; without it an
//!   entry stops only its own node and the rollout goes on elsewhere.
//! - `spec.retry` has no remembered copy in the status type yet, so the last
//!   value seen is kept in a condition of type [`RETRY_OBSERVED_CONDITION`]
//!   (its message is the token). A status without that condition records the
//!   current token and arms nothing, so a new object never retries by itself.
//! - Abandoned attempts are re-issued after `5s · 2^(n-1)` (capped at 5 min)
//!   for `n` consecutive abandoned attempts of the desired state on the node.
//!   `n` is counted from the attempts themselves, so a node's trailing run of
//!   abandoned attempts is kept (up to [`ABANDONED_RUN_KEPT`]) beyond
//!   [`KEEP_ATTEMPTS_PER_NODE`].
//! - A selector that matches no node is `Ready=False NoMatchingNodes` but not
//!   `Stalled`: a pool scaled to zero is a normal state and a node joining
//!   resumes the rollout without anyone acting.

mod conditions;
mod failure_book;
mod naming;
mod outcomes;
mod rollout;

use std::collections::HashMap;
use std::time::Duration;

use genswap_crds::{
    DesiredState, InstanceGeneration, InstanceGenerationSpec, InstanceGenerationStatus, Mode,
    NodeGeneration, SwapAttempt,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

pub use conditions::{RETRY_OBSERVED_CONDITION, reasons};
pub use naming::{LABEL_INSTANCE, LABEL_NODE, attempt_name, label_value};
pub use rollout::{abandoned_backoff, effective_mode, selects};

use failure_book::FailureBook;

/// How many finished attempts per node are kept; older ones are deleted.
pub const KEEP_ATTEMPTS_PER_NODE: usize = 3;

/// How many consecutive abandoned attempts per node are kept at most (beyond
/// [`KEEP_ATTEMPTS_PER_NODE`]): their count is the backoff exponent, and 7
/// reaches the 5-minute cap.
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
    /// Names of attempts to delete (older than the newest few per node, or on
    /// nodes no longer selected).
    pub delete: Vec<String>,
    /// The status to write. `status.sched_rev` is the newest revision issued,
    /// including those in `create`.
    pub status: InstanceGenerationStatus,
    /// Kubernetes Events to record on the InstanceGeneration.
    pub events: Vec<PlanEvent>,
    /// When to look again even if nothing changes (abandoned-attempt backoff).
    pub requeue_after: Option<Duration>,
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
/// `nodes` are all Nodes (the scheduler applies the selector).
pub fn plan(
    ig: &InstanceGeneration,
    attempts: &[SwapAttempt],
    nodes: &[Node],
    now: Timestamp,
) -> Plan {
    let ctx = Context::new(ig, now);
    let previous = ig.status.as_ref();
    let mut status = previous.cloned().unwrap_or_default();
    let mut events = Vec::new();

    let selected = rollout::select_nodes(&ctx.spec.node_selector, nodes);
    let (mut slots, strays, newest_rev) =
        gather(&ctx, &selected, attempts, std::mem::take(&mut status.nodes));

    let mut book = FailureBook::new(std::mem::take(&mut status.held_down));
    for slot in &mut slots {
        outcomes::observe(slot, &mut book, &ctx, &mut events);
    }

    let retry_changed = failure_book::observe_retry_token(
        &mut status.conditions,
        &ctx.spec.retry,
        ctx.generation,
        &ctx.now,
    );
    if retry_changed {
        let armed = book.arm(&ctx.desired.build, ctx.mode);
        if armed > 0 {
            events.push(PlanEvent {
                warning: false,
                reason: "RetryArmed".into(),
                message: format!(
                    "spec.retry changed: build {} ({}) may be attempted once more",
                    ctx.desired.build,
                    mode_name(ctx.mode)
                ),
            });
        }
    }

    let decisions = rollout::decide(&ctx, &slots, &book);

    let mut sched_rev = status.sched_rev.max(newest_rev);
    let mut create = Vec::with_capacity(decisions.issues.len());
    for issue in &decisions.issues {
        sched_rev += 1;
        let slot = &slots[issue.slot];
        events.push(PlanEvent {
            warning: false,
            reason: "AttemptIssued".into(),
            message: format!(
                "node {}: rev {sched_rev}, cause {}, mode {}, build {}{}",
                slot.name,
                cause_name(issue.cause),
                mode_name(ctx.spec.mode),
                ctx.desired.build,
                if slot.canary { ", canary" } else { "" },
            ),
        });
        create.push(naming::build_attempt(
            &ctx,
            slot.name,
            sched_rev,
            issue.cause,
            slot.canary,
        ));
    }

    let mut delete = strays;
    for slot in &slots {
        delete.extend(rollout::expired(&slot.attempts));
    }

    let node_entries: Vec<NodeGeneration> = slots.into_iter().map(|s| s.entry).collect();
    status.good_build = good_build(&node_entries).or(status.good_build);
    status.ready = Some(format!(
        "{}/{}",
        decisions.progress.ready, decisions.progress.selected
    ));
    status.sched_rev = sched_rev;
    status.observed_generation = ctx.generation;
    status.desired = Some(ctx.desired.clone());
    conditions::write(&mut status.conditions, &ctx, &decisions.progress, &book);
    status.nodes = node_entries;
    status.held_down = book.into_entries();

    Plan {
        create,
        delete,
        status,
        events,
        requeue_after: decisions.requeue_after,
    }
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
        }
    }
}

/// One selected node: its place in the rollout, its attempts (oldest first)
/// and the status entry being rewritten.
struct NodeSlot<'a> {
    name: &'a str,
    canary: bool,
    attempts: Vec<&'a SwapAttempt>,
    entry: NodeGeneration,
}

/// Pairs each selected node with its attempts and its previous status entry.
/// Returns the slots, the names of attempts on nodes no longer selected, and
/// the highest revision any attempt of this instance carries.
fn gather<'a>(
    ctx: &Context<'_>,
    selected: &[&'a str],
    attempts: &'a [SwapAttempt],
    previous_entries: Vec<NodeGeneration>,
) -> (Vec<NodeSlot<'a>>, Vec<String>, i64) {
    let mut newest_rev = 0;
    let mut by_node: HashMap<&str, Vec<&SwapAttempt>> = HashMap::with_capacity(selected.len());
    for attempt in attempts {
        // Attempts of another instance are not ours to count or delete.
        if attempt.spec.instance != ctx.name {
            continue;
        }
        newest_rev = newest_rev.max(attempt.spec.sched_rev);
        by_node
            .entry(attempt.spec.node_name.as_str())
            .or_default()
            .push(attempt);
    }
    let mut entries: HashMap<String, NodeGeneration> = previous_entries
        .into_iter()
        .map(|entry| (entry.name.clone(), entry))
        .collect();
    let canaries = usize::try_from(ctx.spec.rollout.canary_nodes).unwrap_or(0);
    let slots = selected
        .iter()
        .enumerate()
        .map(|(index, &name)| {
            let mut attempts = by_node.remove(name).unwrap_or_default();
            attempts.sort_by_key(|a| a.spec.sched_rev);
            NodeSlot {
                name,
                canary: index < canaries,
                attempts,
                entry: entries.remove(name).unwrap_or_else(|| NodeGeneration {
                    name: name.to_string(),
                    generation: None,
                    build: None,
                    sha256: None,
                    config_rev: None,
                    restart_id: None,
                    since: None,
                    last_attempt: None,
                }),
            }
        })
        .collect();
    let mut strays: Vec<&SwapAttempt> = by_node.into_values().flatten().collect();
    strays.sort_by(|a, b| {
        (&a.spec.node_name, a.spec.sched_rev).cmp(&(&b.spec.node_name, b.spec.sched_rev))
    });
    let strays = strays
        .into_iter()
        .filter_map(|a| a.metadata.name.clone())
        .collect();
    (slots, strays, newest_rev)
}

/// The build every selected node serves, when they all serve the same one.
fn good_build(entries: &[NodeGeneration]) -> Option<String> {
    let first = entries.first()?.build.as_ref()?;
    entries
        .iter()
        .all(|e| e.build.as_ref() == Some(first))
        .then(|| first.clone())
}

/// The wire spelling of a mode, for messages.
fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Overlap => "overlap",
        Mode::Hold => "hold",
    }
}

/// The wire spelling of a cause, for messages.
fn cause_name(cause: genswap_crds::Cause) -> &'static str {
    use genswap_crds::Cause;
    match cause {
        Cause::Release => "release",
        Cause::Install => "install",
        Cause::Retry => "retry",
        Cause::Restart => "restart",
        Cause::Config => "config",
    }
}
