//! The reconcile of one InstanceGeneration: read the caches, plan (pure),
//! apply the plan. The planner is a parameter so the adapter can be tested
//! with a fixed plan; production uses [`crate::scheduler::plan`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use genswap_crds::{InstanceGeneration, SwapAttempt};
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::jiff::Timestamp;
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, Resource, ResourceExt};
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::apply::{self, Applied, ApplyError, FIELD_MANAGER};
use crate::attempt_index::AttemptIndex;
use crate::cache_sync::CacheSync;
use crate::events::{EventQueue, Queued};
use crate::expectations::{CaughtUp, Expectations, IgKey};
use crate::leader::Leadership;
use crate::metrics::{Deferral, Metrics};
use crate::observe;
use crate::scheduler::{self, OwnReservation, Plan, PlanEvent, Revisions};

/// The InstanceGeneration as the controller watches it: one that fails to
/// deserialize is still delivered (as an error) instead of breaking the
/// watch for every other object.
pub type WatchedIg = DeserializeGuard<InstanceGeneration>;

/// The pure scheduler, or a stand-in for tests.
pub type Planner = Arc<
    dyn Fn(&InstanceGeneration, &[Arc<SwapAttempt>], &[Node], Timestamp, Revisions) -> Plan
        + Send
        + Sync,
>;

/// The source of `now` handed to the planner.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// How long a healthy InstanceGeneration waits before it is planned again
/// with no event at all: a safety net under the watches.
pub const RESYNC_PERIOD: Duration = Duration::from_secs(10 * 60);

/// How soon to look again when the caches have not yet caught up with this
/// replica's own writes (the watch event normally comes first and wakes the
/// reconcile sooner).
pub const CATCH_UP_RETRY: Duration = Duration::from_secs(1);

/// How long a status write that only records progress may be put off
/// while attempts are in flight (`scheduler::pacing`): the outcome that
/// ends them usually comes sooner and carries it. As long as the Event
/// window: what only reports progress reaches the API server at most that
/// late, in one write; conditions never wait.
pub const PROGRESS_HOLD: Duration = Duration::from_secs(10);

/// How long a reconcile waits in place for the SwapAttempt and Node caches'
/// first list before it gives its slot back and retries.
pub const CACHE_SYNC_WAIT: Duration = Duration::from_secs(5);

/// Reason of the Warning recorded on an InstanceGeneration the controller
/// cannot read.
pub const REASON_INVALID: &str = "InvalidObject";

/// Why a reconcile failed.
#[derive(Debug, Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Apply(#[from] ApplyError),
}

impl ReconcileError {
    /// A short, fixed label for the `error` label of the error metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ReconcileError::Apply(error) => error.metric_label(),
        }
    }
}

/// Everything a reconcile needs, shared by all of them.
pub struct Context {
    pub client: Client,
    pub metrics: Arc<Metrics>,
    pub leadership: Leadership,
    /// Field manager of the status writes.
    pub field_manager: String,
    /// Where a reconcile's Events go; written after it, folded per object.
    pub events: EventQueue,
    /// Every SwapAttempt carrying [`scheduler::LABEL_INSTANCE`], in scope,
    /// by owner.
    pub attempts: AttemptIndex,
    /// Every Node, trimmed by [`observe::trim_node`].
    pub nodes: Store<Node>,
    /// Whether those caches (and the IG cache) have had their first list.
    pub caches: CacheSync,
    /// This replica's writes the caches may not show yet.
    pub expectations: Expectations,
    planner: Planner,
    clock: Clock,
    failures: Mutex<HashMap<ObjectRef<WatchedIg>, u32>>,
    /// Revisions this replica reserved ahead and has not issued, by IG.
    reservations: Mutex<HashMap<IgKey, OwnReservation>>,
    /// Since when each IG's progress-only status write has been put off.
    held: Mutex<HashMap<IgKey, Instant>>,
    /// The Events recorded for each IG since its last status write.
    recorded: Mutex<HashMap<IgKey, HashSet<(String, String)>>>,
    progress_hold: Duration,
}

impl Context {
    /// A context that plans with [`scheduler::plan`] at the wall clock.
    pub fn new(
        client: Client,
        metrics: Arc<Metrics>,
        leadership: Leadership,
        events: EventQueue,
        attempts: AttemptIndex,
        nodes: Store<Node>,
        caches: CacheSync,
    ) -> Self {
        Self {
            client,
            metrics,
            leadership,
            field_manager: FIELD_MANAGER.to_string(),
            events,
            attempts,
            nodes,
            caches,
            expectations: Expectations::default(),
            planner: Arc::new(scheduler::plan_with::<Arc<SwapAttempt>>),
            clock: Arc::new(Timestamp::now),
            failures: Mutex::new(HashMap::new()),
            reservations: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            recorded: Mutex::new(HashMap::new()),
            progress_hold: PROGRESS_HOLD,
        }
    }

    /// Replaces how long a progress-only status write may be put off
    /// (zero: never).
    pub fn with_progress_hold(mut self, hold: Duration) -> Self {
        self.progress_hold = hold;
        self
    }

    /// Replaces the planner.
    pub fn with_planner(mut self, planner: Planner) -> Self {
        self.planner = planner;
        self
    }

    /// Replaces the clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Counts a failure of `object` and returns how many in a row it has had.
    fn record_failure(&self, object: ObjectRef<WatchedIg>) -> u32 {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let count = failures.entry(object).or_insert(0);
        *count = count.saturating_add(1);
        *count
    }

    /// Records that our status write replaced `ig` at its resourceVersion.
    pub(crate) fn note_replaced(&self, ig: &InstanceGeneration) {
        if let Some(version) = ig.resource_version() {
            self.expectations.status_written(&key_of(ig), &version);
        }
    }

    /// Records that our create of `attempt` for `ig` succeeded.
    pub(crate) fn note_created(&self, ig: &InstanceGeneration, attempt: &str) {
        self.expectations
            .created(&key_of(ig), attempt, Instant::now());
    }

    /// Whether the caches show every write this replica made for `ig`.
    fn caught_up(&self, ig: &InstanceGeneration) -> CaughtUp {
        let namespace = ig.namespace().unwrap_or_default();
        let cached = |name: &str| self.attempts.contains(&namespace, name);
        self.expectations.caught_up(
            &key_of(ig),
            ig.resource_version().as_deref(),
            cached,
            Instant::now(),
        )
    }

    /// How revisions are handed out for `ig`: ahead, and from what this
    /// replica reserved earlier.
    fn revisions(&self, ig: &InstanceGeneration) -> Revisions {
        let own = self
            .reservations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key_of(ig))
            .copied();
        Revisions { own, ahead: true }
    }

    /// Records what `ig`'s reservation in hand is after a plan's writes.
    pub(crate) fn note_reservation(&self, ig: &InstanceGeneration, own: OwnReservation) {
        self.reservations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key_of(ig), own);
    }

    /// This replica's reservation in hand for `ig`, if it has one.
    pub(crate) fn own_reservation(&self, ig: &InstanceGeneration) -> Option<OwnReservation> {
        self.revisions(ig).own
    }

    /// Whether `ig`'s progress-only status write may still be put off; the
    /// first put-off starts the clock. Returns how much longer, if so.
    fn hold_progress(&self, ig: &InstanceGeneration, now: Instant) -> Option<Duration> {
        if self.progress_hold.is_zero() {
            return None;
        }
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let since = *held.entry(key_of(ig)).or_insert(now);
        let left = (since + self.progress_hold).saturating_duration_since(now);
        (!left.is_zero()).then_some(left)
    }

    fn release_progress(&self, ig: &InstanceGeneration) {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key_of(ig));
    }

    /// Of `events`, those not recorded since `ig`'s last status write; the
    /// status is written with them unless `put_off`.
    pub(crate) fn events_not_yet_recorded(
        &self,
        ig: &InstanceGeneration,
        events: &[PlanEvent],
        put_off: bool,
    ) -> Vec<PlanEvent> {
        let mut recorded = self.recorded.lock().unwrap_or_else(PoisonError::into_inner);
        let key = key_of(ig);
        let seen = recorded.entry(key.clone()).or_default();
        let fresh = events
            .iter()
            .filter(|e| !seen.contains(&(e.reason.clone(), e.message.clone())))
            .cloned()
            .collect();
        if put_off {
            seen.extend(events.iter().map(|e| (e.reason.clone(), e.message.clone())));
        } else {
            recorded.remove(&key);
        }
        fresh
    }

    /// Forgets what this replica knows of `ig`'s writes.
    fn forget(&self, ig: &InstanceGeneration) {
        let key = key_of(ig);
        self.expectations.forget(&key);
        self.reservations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key);
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key);
        self.recorded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&key);
    }

    fn clear_failures(&self, object: &ObjectRef<WatchedIg>) {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(object);
    }
}

/// Reconciles one InstanceGeneration.
///
/// A follower returns at once without planning: it has nothing to write,
/// and becoming the leader re-plans every object. An object being deleted
/// gets no new attempts (its attempts are garbage-collected with it).
///
/// Planning waits until the caches reflect everything this replica wrote:
/// their first list, its own last status write, and every attempt it
/// created. A plan from a cache behind those would issue a node a second
/// attempt for a desired state it already has one for.
pub async fn reconcile(
    object: Arc<WatchedIg>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let _timer = ctx.metrics.reconcile_started();
    let ig = match &object.0 {
        Ok(ig) => ig,
        Err(invalid) => return Ok(report_invalid(&ctx, invalid)),
    };
    if !ctx.leadership.is_leader() {
        debug!(ig = %ig.name_any(), "follower; not planning");
        ctx.forget(ig);
        return Ok(Action::await_change());
    }
    if ig.meta().deletion_timestamp.is_some() {
        debug!(ig = %ig.name_any(), "being deleted; not planning");
        ctx.forget(ig);
        return Ok(Action::await_change());
    }
    if let Some(retry) = wait_for_caches(ig, &ctx).await {
        return Ok(retry);
    }
    let attempts = ctx.attempts.attempts_of(ig);
    let nodes = observe::nodes(&ctx.nodes);
    let plan = (ctx.planner)(ig, &attempts, &nodes, (ctx.clock)(), ctx.revisions(ig));
    let put_off = if plan.status_may_wait {
        ctx.hold_progress(ig, Instant::now())
    } else {
        None
    };
    if put_off.is_some() {
        ctx.metrics.status_write_put_off();
    }
    let status = match put_off {
        Some(_) => apply::StatusWrite::PutOff,
        None => apply::StatusWrite::Now,
    };
    let applied = apply::apply_plan(&ctx, ig, &plan, status).await?;
    ctx.clear_failures(&ObjectRef::from_obj(&*object));
    match applied {
        Applied::Complete(summary) => {
            debug!(ig = %ig.name_any(), ?summary, "plan applied");
            if summary.status_written || put_off.is_none() {
                ctx.release_progress(ig);
            }
            let next = plan.requeue_after.unwrap_or(RESYNC_PERIOD);
            Ok(Action::requeue(put_off.map_or(next, |left| left.min(next))))
        }
        // The new leader plans from what reached the API server.
        Applied::SteppedDown { .. } => Ok(Action::await_change()),
    }
}

/// Waits for the caches to reflect this replica's writes; returns the
/// requeue when planning must be put off.
async fn wait_for_caches(ig: &InstanceGeneration, ctx: &Context) -> Option<Action> {
    if !ctx.caches.all_synced()
        && tokio::time::timeout(CACHE_SYNC_WAIT, ctx.caches.wait_all())
            .await
            .is_err()
    {
        debug!(ig = %ig.name_any(), "caches still on their first list; waiting");
        ctx.metrics.plan_deferred(Deferral::CachesSyncing);
        return Some(Action::requeue(CATCH_UP_RETRY));
    }
    match ctx.caught_up(ig) {
        CaughtUp::Yes => None,
        CaughtUp::StatusUnseen => {
            // Planning from it would only lose the reservation race to our
            // own write; the watch event of that write re-triggers this IG.
            debug!(ig = %ig.name_any(), "cache behind our own status write; waiting for it");
            ctx.metrics.plan_deferred(Deferral::OwnStatusUnseen);
            Some(Action::requeue(CATCH_UP_RETRY))
        }
        CaughtUp::CreatesUnseen { missing } => {
            // The watch event of each create re-triggers this IG.
            debug!(ig = %ig.name_any(), ?missing, "attempt cache behind our own creates; waiting for it");
            ctx.metrics.plan_deferred(Deferral::OwnCreateUnseen);
            Some(Action::requeue(CATCH_UP_RETRY))
        }
        CaughtUp::GaveUp { missing } => {
            warn!(
                ig = %ig.name_any(),
                ?missing,
                "attempts this replica created never reached its cache; planning without them"
            );
            None
        }
    }
}

fn key_of(ig: &InstanceGeneration) -> IgKey {
    (ig.namespace().unwrap_or_default(), ig.name_any())
}

/// Requeues a failed reconcile with a per-object exponential backoff.
pub fn error_policy(object: Arc<WatchedIg>, error: &ReconcileError, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_failed(error.metric_label());
    let failures = ctx.record_failure(ObjectRef::from_obj(&*object));
    let delay = backoff_delay(failures);
    warn!(
        ig = %object.name_any(),
        namespace = object.namespace().unwrap_or_default(),
        %error,
        failures,
        retry_in = ?delay,
        "reconcile failed"
    );
    Action::requeue(delay)
}

/// 0.5 s, 1 s, 2 s, ... capped at five minutes. A conflict is retried
/// quickly; the watch event of the write that won usually comes first anyway.
pub fn backoff_delay(consecutive_failures: u32) -> Duration {
    const BASE: Duration = Duration::from_millis(500);
    const CAP: Duration = Duration::from_secs(300);
    let exponent = consecutive_failures.saturating_sub(1).min(16);
    BASE.saturating_mul(1 << exponent).min(CAP)
}

/// Logs an InstanceGeneration the controller cannot deserialize and, as the
/// leader, records a Warning on it; then waits for it to change.
fn report_invalid(ctx: &Context, invalid: &InvalidObject) -> Action {
    let name = invalid.metadata.name.clone().unwrap_or_default();
    ctx.metrics.reconcile_failed("invalid_object");
    warn!(ig = %name, error = %invalid.error, "cannot read InstanceGeneration; skipping it");
    if ctx.leadership.is_leader() {
        let regarding = ObjectReference {
            api_version: Some(InstanceGeneration::api_version(&()).into_owned()),
            kind: Some(InstanceGeneration::kind(&()).into_owned()),
            name: invalid.metadata.name.clone(),
            namespace: invalid.metadata.namespace.clone(),
            uid: invalid.metadata.uid.clone(),
            resource_version: invalid.metadata.resource_version.clone(),
            ..ObjectReference::default()
        };
        let queued = Queued {
            warning: true,
            reason: REASON_INVALID.to_string(),
            note: format!(
                "the controller cannot read this object and skips it: {}",
                invalid.error
            ),
            regarding,
        };
        if !ctx.events.record(queued) {
            ctx.metrics.reconcile_failed("event_queue_full");
            info!(ig = %name, "the Event queue is full; dropping the InvalidObject Event");
        }
    }
    Action::await_change()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_half_a_second_up_to_five_minutes() {
        assert_eq!(backoff_delay(1), Duration::from_millis(500));
        assert_eq!(backoff_delay(2), Duration::from_secs(1));
        assert_eq!(backoff_delay(4), Duration::from_secs(4));
        assert_eq!(backoff_delay(30), Duration::from_secs(300));
        assert_eq!(backoff_delay(u32::MAX), Duration::from_secs(300));
    }
}
