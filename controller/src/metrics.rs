//! Prometheus metrics of the controller, in the OpenMetrics text format.
//!
//! Every name carries the `genswap_controller_` prefix; see
//! `docs/CONTROLLER.md` for what each one means.

use std::time::Instant;

use genswap_core::scheduler::Verdict;
use genswap_crds::{Cause, Mode, Outcome};
use genswap_runtime::http::Exposition;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// The prefix of every metric name.
pub const PREFIX: &str = "genswap_controller";

/// Labels of `reconcile_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    error: String,
}

/// Labels of `attempts_issued_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    cause: String,
    mode: String,
}

/// Labels of `outcomes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
    mode: String,
}

/// Labels of `plans_deferred_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeferLabels {
    reason: String,
}

/// Labels of `analysis_measurements_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabels {
    verdict: String,
}

/// Why a reconcile put off planning until its caches caught up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deferral {
    /// The SwapAttempt or Node cache had not finished its first list.
    CachesSyncing,
    /// The cached InstanceGeneration predates this replica's own status write.
    OwnStatusUnseen,
    /// The attempt cache lacks an attempt this replica created.
    OwnCreateUnseen,
    /// The attempt cache does not show a node record this replica wrote.
    OwnRecordUnseen,
    /// This replica has just become the leader and has not yet listed the
    /// attempts its cache may lack ([`crate::term`]).
    TermNotSeeded,
    /// An attempt this replica expected was still missing from its cache
    /// after the patience, and the API server holds it (or could not say).
    CacheBehindServer,
}

impl Deferral {
    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Deferral::CachesSyncing => "caches_syncing",
            Deferral::OwnStatusUnseen => "own_status_unseen",
            Deferral::OwnCreateUnseen => "own_create_unseen",
            Deferral::OwnRecordUnseen => "own_record_unseen",
            Deferral::TermNotSeeded => "term_not_seeded",
            Deferral::CacheBehindServer => "cache_behind_server",
        }
    }
}

/// The controller's metrics and the registry that exposes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    reconcile_errors: Family<ErrorLabels, Counter>,
    attempts_issued: Family<AttemptLabels, Counter>,
    outcomes: Family<OutcomeLabels, Counter>,
    plans_deferred: Family<DeferLabels, Counter>,
    status_writes_put_off: Counter,
    waves_started: Counter,
    progress_deadlines_exceeded: Counter,
    analysis_measurements: Family<VerdictLabels, Counter>,
    reconcile_duration: Histogram,
    leader: Gauge,
    attempts_cached: Gauge,
    heap_in_use: Gauge,
    heap_held_free: Gauge,
    heap: HeapReader,
}

/// Reads the process's heap: the allocator's own count.
pub type HeapReader = fn() -> Option<genswap_runtime::heap::HeapUsage>;

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let reconciles = Counter::default();
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let attempts_issued = Family::<AttemptLabels, Counter>::default();
        let outcomes = Family::<OutcomeLabels, Counter>::default();
        let plans_deferred = Family::<DeferLabels, Counter>::default();
        let status_writes_put_off = Counter::default();
        let waves_started = Counter::default();
        let progress_deadlines_exceeded = Counter::default();
        let analysis_measurements = Family::<VerdictLabels, Counter>::default();
        // 1 ms .. ~16 s: a reconcile is a few API calls at most.
        let reconcile_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        let leader = Gauge::default();
        let attempts_cached = Gauge::default();
        let heap_in_use = Gauge::default();
        let heap_held_free = Gauge::default();
        registry.register(
            "reconciles",
            "Reconciles of InstanceGenerations started",
            reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Reconciles that failed, by error kind",
            reconcile_errors.clone(),
        );
        registry.register(
            "attempts_issued",
            "SwapAttempts created, by cause and mode",
            attempts_issued.clone(),
        );
        registry.register(
            "outcomes",
            "Attempt outcomes newly recorded in a node's record, by outcome and mode",
            outcomes.clone(),
        );
        registry.register(
            "plans_deferred",
            "Reconciles that put off planning until the watch caches caught up, by reason",
            plans_deferred.clone(),
        );
        registry.register(
            "status_writes_put_off",
            "Reconciles that put off a status write recording only progress while attempts were in flight",
            status_writes_put_off.clone(),
        );
        registry.register(
            "rollout_waves_started",
            "Rollout waves (the canaries' included) whose nodes started, as the status recorded them",
            waves_started.clone(),
        );
        registry.register(
            "progress_deadlines_exceeded",
            "Rollouts that turned Stalled with ProgressDeadlineExceeded",
            progress_deadlines_exceeded.clone(),
        );
        registry.register(
            "analysis_measurements",
            "rollout.analysis measurements taken, by verdict (pass, fail, inconclusive)",
            analysis_measurements.clone(),
        );
        registry.register_with_unit(
            "reconcile_duration",
            "Time one reconcile took, reads and writes included",
            Unit::Seconds,
            reconcile_duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease and may write, else 0",
            leader.clone(),
        );
        registry.register(
            "attempts_cached",
            "SwapAttempts in this replica's cache",
            attempts_cached.clone(),
        );
        registry.register_with_unit(
            "heap_in_use",
            "Heap handed out and not freed, as the allocator counts it",
            Unit::Bytes,
            heap_in_use.clone(),
        );
        registry.register_with_unit(
            "heap_held_free",
            "Resident heap beyond what is handed out: freed pages not yet returned, fragments",
            Unit::Bytes,
            heap_held_free.clone(),
        );
        Self {
            registry,
            reconciles,
            reconcile_errors,
            attempts_issued,
            outcomes,
            plans_deferred,
            status_writes_put_off,
            waves_started,
            progress_deadlines_exceeded,
            analysis_measurements,
            reconcile_duration,
            leader,
            attempts_cached,
            heap_in_use,
            heap_held_free,
            heap: genswap_runtime::heap::usage,
        }
    }

    /// The heap gauges read by `heap` instead of glibc's counters: the
    /// binary's allocator is jemalloc (`src/allocator.rs`).
    pub fn with_heap(self, heap: HeapReader) -> Self {
        Self { heap, ..self }
    }

    /// The registry in the OpenMetrics text format, the heap read now.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        if let Some(heap) = (self.heap)() {
            self.heap_in_use.set(saturating_i64(heap.in_use));
            self.heap_held_free.set(saturating_i64(heap.held_free));
        }
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }

    /// Counts a reconcile and returns a guard that records its duration when
    /// dropped, so early returns and errors are measured too.
    pub fn reconcile_started(&self) -> ReconcileTimer {
        self.reconciles.inc();
        ReconcileTimer {
            started: Instant::now(),
            histogram: self.reconcile_duration.clone(),
        }
    }

    /// Counts a failed reconcile under its error kind.
    pub fn reconcile_failed(&self, error: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels {
                error: error.to_string(),
            })
            .inc();
    }

    /// Counts one `rollout.analysis` measurement by its verdict.
    pub fn analysis_measured(&self, verdict: &Verdict) {
        let verdict = match verdict {
            Verdict::Pass => "pass",
            Verdict::Fail(_) => "fail",
            Verdict::Inconclusive(_) => "inconclusive",
        };
        self.analysis_measurements
            .get_or_create(&VerdictLabels {
                verdict: verdict.to_string(),
            })
            .inc();
    }

    /// Counts one SwapAttempt the API server accepted.
    pub fn attempt_issued(&self, cause: Cause, mode: Mode) {
        self.attempts_issued
            .get_or_create(&AttemptLabels {
                cause: cause.as_str().to_string(),
                mode: mode.as_str().to_string(),
            })
            .inc();
    }

    /// Counts one outcome recorded in status for the first time.
    pub fn outcome_recorded(&self, outcome: Outcome, mode: Mode) {
        self.outcomes
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str().to_string(),
                mode: mode.as_str().to_string(),
            })
            .inc();
    }

    /// Counts one reconcile that put off planning.
    pub fn plan_deferred(&self, why: Deferral) {
        self.plans_deferred
            .get_or_create(&DeferLabels {
                reason: why.label().to_string(),
            })
            .inc();
    }

    /// Counts one status write put off.
    pub fn status_write_put_off(&self) {
        self.status_writes_put_off.inc();
    }

    /// Counts a rollout wave whose nodes started.
    pub fn wave_started(&self) {
        self.waves_started.inc();
    }

    /// Counts a rollout that passed its progress deadline.
    pub fn progress_deadline_exceeded(&self) {
        self.progress_deadlines_exceeded.inc();
    }

    /// Sets the leader gauge.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }

    /// Sets how many attempts the cache holds.
    pub fn set_attempts_cached(&self, count: usize) {
        self.attempts_cached.set(saturating_i64(count as u64));
    }
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

impl Exposition for Metrics {
    fn encode_text(&self) -> Result<String, std::fmt::Error> {
        self.encode()
    }
}

/// Measures one reconcile; records into the duration histogram on drop.
#[derive(Debug)]
pub struct ReconcileTimer {
    started: Instant,
    histogram: Histogram,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.histogram.observe(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_every_metric_with_its_labels() {
        let metrics = Metrics::new();
        drop(metrics.reconcile_started());
        metrics.reconcile_failed("conflict");
        metrics.attempt_issued(Cause::Install, Mode::Overlap);
        metrics.outcome_recorded(Outcome::Done, Mode::Hold);
        metrics.plan_deferred(Deferral::OwnCreateUnseen);
        metrics.status_write_put_off();
        metrics.set_leader(true);
        metrics.set_attempts_cached(3);
        let text = metrics.encode().expect("registry encodes");
        for line in [
            "genswap_controller_reconciles_total 1",
            "genswap_controller_reconcile_errors_total{error=\"conflict\"} 1",
            "genswap_controller_attempts_issued_total{cause=\"install\",mode=\"overlap\"} 1",
            "genswap_controller_outcomes_total{outcome=\"done\",mode=\"hold\"} 1",
            "genswap_controller_plans_deferred_total{reason=\"own_create_unseen\"} 1",
            "genswap_controller_status_writes_put_off_total 1",
            "genswap_controller_reconcile_duration_seconds_count 1",
            "genswap_controller_leader 1",
            "genswap_controller_attempts_cached 3",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        assert!(
            text.lines()
                .any(|l| l.starts_with("genswap_controller_heap_in_use_bytes ")
                    && !l.ends_with(" 0")),
            "no heap figure in\n{text}"
        );
    }
}
