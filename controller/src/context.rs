//! What every reconcile shares ([`Context`]): the clients, the caches it
//! plans from, and what this replica remembers of its own writes (the
//! caches' expectations, the revisions it reserved and has not issued, the
//! progress writes it is holding, the Events it sent meanwhile). The planner
//! is a parameter so the adapter can be tested with a fixed plan; production
//! uses [`genswap_core::scheduler::plan_with`].

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use genswap_core::scheduler::{self, OwnReservation, Plan, PlanEvent, Revisions};
use genswap_crds::{InstanceGeneration, SwapAttempt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use tokio::sync::Semaphore;

use genswap_runtime::prometheus::Prometheus;

use crate::attempt_index::AttemptIndex;
use crate::cache_sync::CacheSync;
use crate::events::EventQueue;
use crate::expectations::{CaughtUp, Expectations, IgKey};
use crate::leader::Leadership;
use crate::metrics::Metrics;
use crate::observe::WatchedIg;

/// The field manager of every status write.
pub const FIELD_MANAGER: &str = "genswap-controller";

/// The pure scheduler, or a stand-in for tests.
pub type Planner = Arc<
    dyn Fn(&InstanceGeneration, &[SwapAttempt], &[Node], Timestamp, Revisions) -> Plan
        + Send
        + Sync,
>;

/// The source of `now` handed to the planner.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// How long a status write that only records progress may be put off
/// while attempts are in flight (`scheduler::pacing`): the outcome that
/// ends them usually comes sooner and carries it. As long as the Event
/// window: what only reports progress reaches the API server at most that
/// late, in one write; conditions never wait.
pub const PROGRESS_HOLD: Duration = Duration::from_secs(10);

/// SwapAttempt creates in flight at once, across every reconcile. A
/// release of many IGs plans thousands of creates together; sent all at
/// once they met the API server's in-flight limit, and the fleet bench saw
/// four refused (429) for every one stored, each burning its revision and
/// costing a re-plan. Kubernetes' own controllers pace their creates too
/// (client-go's QPS, the ReplicaSet controller's slow-start batches). The
/// node records' patches and the deletes of old attempts share the permits.
pub const CREATES_AT_ONCE: usize = 32;

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
    pub(crate) planner: Planner,
    pub(crate) clock: Clock,
    /// Where `rollout.analysis` is measured.
    pub(crate) prometheus: Option<Prometheus>,
    failures: Mutex<HashMap<ObjectRef<WatchedIg>, u32>>,
    /// Revisions this replica reserved ahead and has not issued, by IG.
    reservations: Mutex<HashMap<IgKey, OwnReservation>>,
    /// Since when each IG's progress-only status write has been put off.
    held: Mutex<HashMap<IgKey, Instant>>,
    /// The Events recorded for each IG since its last status write.
    recorded: Mutex<HashMap<IgKey, HashSet<(String, String)>>>,
    progress_hold: Duration,
    /// Permits for SwapAttempt writes (creates, record patches, deletes) in
    /// flight, shared by every reconcile.
    pub(crate) create_permits: Arc<Semaphore>,
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
            planner: Arc::new(scheduler::plan_with::<SwapAttempt>),
            clock: Arc::new(Timestamp::now),
            prometheus: None,
            failures: Mutex::new(HashMap::new()),
            reservations: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
            recorded: Mutex::new(HashMap::new()),
            progress_hold: PROGRESS_HOLD,
            create_permits: Arc::new(Semaphore::new(CREATES_AT_ONCE)),
        }
    }

    /// Sets the Prometheus `rollout.analysis` asks.
    pub fn with_prometheus(mut self, prometheus: Option<Prometheus>) -> Self {
        self.prometheus = prometheus;
        self
    }

    /// Replaces how long a progress-only status write may be put off
    /// (zero: never).
    pub fn with_progress_hold(mut self, hold: Duration) -> Self {
        self.progress_hold = hold;
        self
    }

    /// Replaces how long a create may stay unseen before the API server is
    /// asked whether it holds it ([`crate::expectations::PATIENCE`]).
    pub fn with_patience(mut self, patience: Duration) -> Self {
        self.expectations = Expectations::with_patience(patience);
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
    pub(crate) fn record_failure(&self, object: ObjectRef<WatchedIg>) -> u32 {
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

    /// Records that `attempt` of `ig` is deleted (or was already gone).
    pub(crate) fn note_deleted(&self, ig: &InstanceGeneration, attempt: &str) {
        self.expectations.deleted(&key_of(ig), attempt);
    }

    /// Those of the plan's `deletes` this replica has not deleted already
    /// (a plan made before the watch showed a deletion lists it again).
    pub(crate) fn still_to_delete(
        &self,
        ig: &InstanceGeneration,
        deletes: &[String],
    ) -> Vec<String> {
        let namespace = ig.namespace().unwrap_or_default();
        self.expectations
            .still_to_delete(&key_of(ig), deletes, |name| {
                self.attempts.contains(&namespace, name)
            })
    }

    /// Records that our patch wrote `record` onto `attempt` of `ig`.
    pub(crate) fn note_record(&self, ig: &InstanceGeneration, attempt: &str, record: String) {
        self.expectations
            .record_written(&key_of(ig), attempt, record, Instant::now());
    }

    /// Whether the caches show every write this replica made for `ig`.
    pub(crate) fn caught_up(&self, ig: &InstanceGeneration) -> CaughtUp {
        let namespace = ig.namespace().unwrap_or_default();
        let cached = |name: &str| self.attempts.contains(&namespace, name);
        let now = Instant::now();
        let key = key_of(ig);
        let creates =
            self.expectations
                .caught_up(&key, ig.resource_version().as_deref(), cached, now);
        if creates != CaughtUp::Yes {
            return creates;
        }
        let shows = |attempt: &str, record: &str| match self.attempts.record_on(&namespace, attempt)
        {
            None => true,
            Some(cached) => cached.as_deref() == Some(record),
        };
        self.expectations.records_caught_up(&key, shows, now)
    }

    /// How revisions are handed out for `ig`: ahead, and from what this
    /// replica reserved earlier.
    pub(crate) fn revisions(&self, ig: &InstanceGeneration) -> Revisions {
        let own = self
            .reservations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key_of(ig))
            .copied();
        Revisions { own, ahead: true }
    }

    /// Records what `ig`'s reservation in hand is after a plan's writes.
    /// A used-up reservation is dropped rather than kept: it can issue
    /// nothing, and an IG deleted later leaves no entry behind.
    pub(crate) fn note_reservation(&self, ig: &InstanceGeneration, own: OwnReservation) {
        let mut reservations = self
            .reservations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if own.issued < own.reserved {
            reservations.insert(key_of(ig), own);
        } else {
            reservations.remove(&key_of(ig));
        }
    }

    /// This replica's reservation in hand for `ig`, if it has one.
    pub(crate) fn own_reservation(&self, ig: &InstanceGeneration) -> Option<OwnReservation> {
        self.revisions(ig).own
    }

    /// Whether `ig`'s progress-only status write may still be put off; the
    /// first put-off starts the clock. Returns how much longer, if so.
    pub(crate) fn hold_progress(&self, ig: &InstanceGeneration, now: Instant) -> Option<Duration> {
        if self.progress_hold.is_zero() {
            return None;
        }
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let since = *held.entry(key_of(ig)).or_insert(now);
        let left = (since + self.progress_hold).saturating_duration_since(now);
        (!left.is_zero()).then_some(left)
    }

    pub(crate) fn release_progress(&self, ig: &InstanceGeneration) {
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

    /// Forgets what this replica knows of `ig`'s writes: it is being
    /// deleted.
    pub(crate) fn forget(&self, ig: &InstanceGeneration) {
        self.expectations.forget(&key_of(ig));
        self.step_down(ig);
    }

    /// Forgets what only a leader may use of `ig` (its reservation in hand,
    /// its put-off status and Events), and keeps the expectations of its own
    /// writes but those the caches now show: a create in flight as the Lease
    /// was lost lands all the same, and a plan as leader again must not miss
    /// it.
    pub(crate) fn step_down(&self, ig: &InstanceGeneration) {
        let key = key_of(ig);
        let _ = self.caught_up(ig);
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

    pub(crate) fn clear_failures(&self, object: &ObjectRef<WatchedIg>) {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(object);
    }
}

pub(crate) fn key_of(ig: &InstanceGeneration) -> IgKey {
    (ig.namespace().unwrap_or_default(), ig.name_any())
}
