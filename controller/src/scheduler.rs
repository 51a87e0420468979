//! The scheduler: a pure function from what the API server holds to what the
//! controller should write. No client, no clock of its own.

use std::time::Duration;

use genswap_crds::{InstanceGeneration, InstanceGenerationStatus, SwapAttempt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;

/// How many finished attempts per node are kept; older ones are deleted.
pub const KEEP_ATTEMPTS_PER_NODE: usize = 3;

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
    let _ = (ig, attempts, nodes, now);
    Plan::default()
}
