//! Writing attempt outcomes to `SwapAttempt/status` (SPEC §3.2, §5.7).
//!
//! Every write is a server-side apply of the `status` subresource with the
//! field manager [`FIELD_MANAGER`], forced: the agent is the only writer of
//! an attempt's status, so it owns every field it sets, and an apply states
//! the whole status the agent wants, never a diff. Every write carries the
//! attempt's `observedGeneration` and is cut to a size the server accepts.
//!
//! Two writes per attempt, built by the status functions standalone mode
//! uses too (`crate::standalone::report`), so both modes report alike:
//! - once it has run for the running-report delay (1 s by default, so a
//!   swap that ends sooner costs the API server one write, not two),
//!   [`running_status`]: `startedAt`, `effectiveMode` and
//!   `Reconciling=True` (retried until the attempt ends; the final write
//!   replaces it);
//! - when it ends, [`status_from_outcome_record`]: outcome, effective
//!   mode, generation, reason, executed, clean exit, drain, steps, both
//!   timestamps, and the conditions `Ready` (True on done), `Stalled` (True
//!   on failed and down) and `Reconciling=False`.
//!
//! A stage-only attempt's progress and outcome (`crate::prestage`) go
//! through the same apply; they are not journaled: a restarted agent
//! stages it again.
//!
//! The final write is retried with a bounded, jittered exponential backoff
//! ([`ReportBackoff`]) until the API server accepts it. Only then is the
//! outcome acknowledged in the intent journal ([`Ledger::acknowledge`]); until
//! then it stays there and a restarted agent delivers it again. A 404 means
//! the attempt was deleted: nobody can read the outcome any more, so it is
//! acknowledged and dropped.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use genswap_crds::{Mode, Outcome, ServingStatus, SwapAttempt, SwapAttemptSpec, SwapAttemptStatus};
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use thiserror::Error;

use crate::attempt_status::{status_from_outcome_record, status_running};
use crate::engine::{Cancel, Engine, SwapResult, effective_mode};
use crate::gate::InstanceKey;
use crate::journal::{Journal, JournalError, OutcomeRecord, Record, unix_millis_now};
use crate::metrics::AgentMetrics;

/// The server-side apply field manager of every status write.
pub const FIELD_MANAGER: &str = "genswap-node-agent";

/// The field manager of the `serving` block alone (SPEC 5.10). Its own
/// manager, so that the outcome's apply (which leaves `serving` out) and
/// this one (which states only `serving`) never remove each other's fields.
pub const SERVING_FIELD_MANAGER: &str = "genswap-node-agent-supervisor";

/// How long one status write may take before it counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// The longest reason or condition message written.
const MAX_MESSAGE: usize = 4096;

/// How a failed status write is retried: `initial`, doubling up to `max`,
/// each delay jittered down by up to half so many agents do not retry in step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReportBackoff {
    /// The first delay.
    pub initial: Duration,
    /// The ceiling of every delay.
    pub max: Duration,
}

impl Default for ReportBackoff {
    /// 200 ms doubling to 4 s: short enough that an outcome reaches the API
    /// server within a few seconds of its coming back after an outage, and
    /// still at most one write per pending outcome every 2 to 4 s while down.
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(200),
            max: Duration::from_secs(4),
        }
    }
}

impl ReportBackoff {
    /// The un-jittered delay before retry number `retry` (0 is the first).
    pub fn ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX);
        self.initial
            .checked_mul(factor)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The delay before retry number `retry`: in `[ceiling/2, ceiling]`.
    pub fn delay(&self, retry: u32) -> Duration {
        let ceiling = self.ceiling(retry);
        ceiling / 2 + ceiling.mul_f64(jitter_fraction() / 2.0)
    }
}

/// A fraction in `[0, 1)` that differs between calls and between agents.
fn jitter_fraction() -> f64 {
    let mut hasher = RandomState::new().build_hasher();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    hasher.write_u128(nanos);
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Which SwapAttempt a report is written to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportTarget {
    /// The attempt's namespace.
    pub namespace: String,
    /// The attempt's name.
    pub name: String,
    /// The instance it moves; `None` when its namespace and `spec.instance`
    /// name no valid instance (nothing to acknowledge in the journal then).
    pub instance: Option<InstanceKey>,
    /// Its scheduler revision.
    pub sched_rev: i64,
    /// `metadata.generation` as last seen, written as the conditions'
    /// `observedGeneration`; `None` when only the journal knew the attempt.
    pub observed_generation: Option<i64>,
}

impl ReportTarget {
    /// The target for an attempt object.
    pub fn of_attempt(attempt: &SwapAttempt, instance: Option<InstanceKey>) -> Self {
        Self {
            namespace: attempt.metadata.namespace.clone().unwrap_or_default(),
            name: attempt.metadata.name.clone().unwrap_or_default(),
            instance,
            sched_rev: attempt.spec.sched_rev,
            observed_generation: attempt.metadata.generation,
        }
    }

    /// The target for a journal record.
    pub fn of_record(record: &Record) -> Self {
        Self {
            namespace: record.instance.namespace().to_string(),
            name: record.attempt.name.clone(),
            instance: Some(record.instance.clone()),
            sched_rev: record.attempt.sched_rev,
            observed_generation: None,
        }
    }
}

impl std::fmt::Display for ReportTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} (schedRev {})",
            self.namespace, self.name, self.sched_rev
        )
    }
}

/// The attempt a `serving` block is written to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingTarget {
    pub namespace: String,
    pub name: String,
}

/// A finished attempt's outcome and where it goes.
#[derive(Clone, Debug, PartialEq)]
pub struct OutcomeReport {
    pub target: ReportTarget,
    pub outcome: OutcomeRecord,
}

impl OutcomeReport {
    /// The report of an attempt the engine ran.
    pub fn from_result(target: ReportTarget, result: &SwapResult) -> Self {
        Self {
            target,
            outcome: OutcomeRecord {
                outcome: result.outcome,
                effective_mode: result.effective_mode,
                generation: result.generation,
                reason: result.reason.clone(),
                executed: result.executed,
                clean_exit: result.clean_exit,
                drain_ms: result.drain_ms(),
                listener_handover: result.listener_handover,
                steps: result.step_timings(),
                started_at_ms: system_millis(result.started_at),
                finished_at_ms: system_millis(result.finished_at),
            },
        }
    }

    /// The report of a finished record in the journal; `None` while the
    /// record has no outcome.
    pub fn from_record(record: &Record) -> Option<Self> {
        Some(Self {
            target: ReportTarget::of_record(record),
            outcome: record.outcome.clone()?,
        })
    }

    /// An attempt abandoned before the engine took it (superseded, or
    /// unusable): nothing of it ran.
    pub fn abandoned_unrun(target: ReportTarget, spec: &SwapAttemptSpec, reason: String) -> Self {
        let now = unix_millis_now();
        Self {
            target,
            outcome: OutcomeRecord {
                outcome: Outcome::Abandoned,
                effective_mode: effective_mode(spec),
                generation: None,
                reason,
                executed: false,
                clean_exit: false,
                drain_ms: None,
                listener_handover: None,
                steps: Vec::new(),
                started_at_ms: now,
                finished_at_ms: now,
            },
        }
    }
}

fn system_millis(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The status of an attempt that has started: `startedAt`, the effective
/// mode, `Reconciling=True` (as [`status_running`] builds it for both modes).
pub fn running_status(mode: Mode, started_at_ms: i64) -> SwapAttemptStatus {
    let started_at = UNIX_EPOCH + Duration::from_millis(u64::try_from(started_at_ms).unwrap_or(0));
    let mut status = status_running(started_at);
    status.effective_mode = Some(mode);
    status
}

/// Sets the conditions' `observedGeneration` and cuts long texts: a reason
/// can quote a long error (a stage's included), and a write the server
/// refuses for its size would be retried forever.
fn fit_for_the_api(status: &mut SwapAttemptStatus, observed_generation: Option<i64>) {
    for condition in &mut status.conditions {
        condition.observed_generation = observed_generation;
        cut(&mut condition.message);
    }
    if let Some(reason) = status.reason.as_mut() {
        cut(reason);
    }
}

fn cut(text: &mut String) {
    if text.len() <= MAX_MESSAGE {
        return;
    }
    let mut end = MAX_MESSAGE;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push('…');
}

/// The server-side apply body for `status`.
pub fn apply_body(status: &SwapAttemptStatus) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": format!("{}/{}", genswap_crds::GROUP, genswap_crds::VERSION),
        "kind": "SwapAttempt",
        "status": status,
    })
}

/// Where accepted outcomes are acknowledged: the intent journal.
pub trait Ledger: Send + Sync + 'static {
    /// Drops the outcome of `instance`'s attempt `sched_rev` (see
    /// [`Journal::acknowledge`]).
    fn acknowledge(&self, instance: &InstanceKey, sched_rev: i64) -> Result<bool, JournalError>;
}

impl Ledger for Journal {
    fn acknowledge(&self, instance: &InstanceKey, sched_rev: i64) -> Result<bool, JournalError> {
        Journal::acknowledge(self, instance, sched_rev)
    }
}

impl Ledger for Engine {
    fn acknowledge(&self, instance: &InstanceKey, sched_rev: i64) -> Result<bool, JournalError> {
        self.journal().acknowledge(instance, sched_rev)
    }
}

/// Why one status write failed.
#[derive(Debug, Error)]
pub enum ReportError {
    #[error("writing the status of {target} failed: {source}")]
    Api {
        target: String,
        #[source]
        source: kube::Error,
    },
    #[error("the status write of {target} took longer than {REQUEST_TIMEOUT:?}")]
    Timeout { target: String },
}

impl ReportError {
    /// The attempt is gone (404).
    pub fn is_not_found(&self) -> bool {
        matches!(self, ReportError::Api { source: kube::Error::Api(status), .. } if status.is_not_found())
    }
}

/// How a delivery ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivered {
    /// The API server accepted the status; the outcome was acknowledged.
    Accepted,
    /// The attempt no longer exists; the outcome was acknowledged and dropped.
    Gone,
}

/// Writes statuses and acknowledges accepted outcomes. Cheap to clone.
#[derive(Clone)]
pub struct Reporter {
    client: Client,
    ledger: Arc<dyn Ledger>,
    backoff: ReportBackoff,
    metrics: Arc<AgentMetrics>,
}

impl Reporter {
    /// A reporter over `client` that acknowledges in `ledger`.
    pub fn new(
        client: Client,
        ledger: Arc<dyn Ledger>,
        backoff: ReportBackoff,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        Self {
            client,
            ledger,
            backoff,
            metrics,
        }
    }

    /// Writes `report` until the API server accepts it (or says the attempt
    /// is gone), then acknowledges it in the journal. It never gives up on
    /// its own: bound it from outside (shutdown aborts it; the outcome stays
    /// in the journal for the next start).
    pub async fn deliver(&self, report: &OutcomeReport) -> Delivered {
        let _backlog = BacklogEntry::new(&self.metrics);
        let status = status_from_outcome_record(&report.outcome);
        let delivered = self
            .apply_until_settled(
                &report.target,
                &status,
                "writing an attempt's outcome failed; it stays in the journal and is retried",
            )
            .await;
        if delivered == Delivered::Gone {
            tracing::warn!(
                attempt = %report.target,
                outcome = ?report.outcome.outcome,
                "the SwapAttempt was deleted before its outcome was written; the outcome is dropped"
            );
        }
        self.acknowledge(&report.target).await;
        delivered
    }

    /// Writes the running status of an attempt that has just started,
    /// retrying until accepted, the attempt is gone, or `until` ends (the
    /// attempt finished: its final write replaces this one). A write in
    /// flight is never cut off, so this one cannot land after the final one.
    pub async fn report_started(
        &self,
        target: &ReportTarget,
        mode: Mode,
        started_at_ms: i64,
        until: &Cancel,
    ) {
        let status = running_status(mode, started_at_ms);
        let mut retry = 0u32;
        loop {
            match self.apply(target, &status).await {
                Ok(()) => return,
                Err(error) if error.is_not_found() => return,
                Err(error) => {
                    tracing::debug!(attempt = %target, error = %error_chain(&error), "writing that an attempt started failed");
                }
            }
            tokio::select! {
                () = until.cancelled() => return,
                () = tokio::time::sleep(self.backoff.delay(retry)) => {}
            }
            retry = retry.saturating_add(1);
        }
    }

    /// Writes an attempt's `serving` block until the API server accepts it
    /// or says the attempt is gone. Abort it to replace it with a newer
    /// state.
    pub async fn deliver_serving(&self, target: &ServingTarget, serving: &ServingStatus) {
        let api: Api<SwapAttempt> = Api::namespaced(self.client.clone(), &target.namespace);
        let params = PatchParams::apply(SERVING_FIELD_MANAGER).force();
        let mut serving = serving.clone();
        if let Some(message) = serving.message.as_mut() {
            cut(message);
        }
        let body = serde_json::json!({
            "apiVersion": format!("{}/{}", genswap_crds::GROUP, genswap_crds::VERSION),
            "kind": "SwapAttempt",
            "status": { "serving": serving },
        });
        let mut retry = 0u32;
        loop {
            let written = tokio::time::timeout(
                REQUEST_TIMEOUT,
                api.patch_status(&target.name, &params, &Patch::Apply(&body)),
            )
            .await;
            let error = match written {
                Ok(Ok(_)) => return,
                Ok(Err(kube::Error::Api(status))) if status.is_not_found() => return,
                Ok(Err(error)) => error_chain(&error),
                Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
            };
            let delay = self.backoff.delay(retry);
            tracing::warn!(
                attempt = %format!("{}/{}", target.namespace, target.name),
                %error,
                retry_in_ms = delay.as_millis() as u64,
                "writing an instance's serving state failed; retrying"
            );
            tokio::time::sleep(delay).await;
            retry = retry.saturating_add(1);
        }
    }

    /// Writes `status` until the API server accepts it or says the
    /// attempt is gone: an outcome nothing journals (a stage-only attempt),
    /// which a restart would stage again.
    pub async fn deliver_status(&self, target: &ReportTarget, status: &SwapAttemptStatus) {
        self.apply_until_settled(
            target,
            status,
            "writing an attempt's status failed; retrying",
        )
        .await;
    }

    /// Applies `status` until the API server accepts it or says the attempt
    /// is gone, backing off between failures, each logged as `failing`.
    async fn apply_until_settled(
        &self,
        target: &ReportTarget,
        status: &SwapAttemptStatus,
        failing: &str,
    ) -> Delivered {
        let mut retry = 0u32;
        loop {
            match self.apply(target, status).await {
                Ok(()) => return Delivered::Accepted,
                Err(error) if error.is_not_found() => return Delivered::Gone,
                Err(error) => {
                    let delay = self.backoff.delay(retry);
                    tracing::warn!(
                        attempt = %target,
                        error = %error_chain(&error),
                        retry_in_ms = delay.as_millis() as u64,
                        "{failing}"
                    );
                    tokio::time::sleep(delay).await;
                    retry = retry.saturating_add(1);
                }
            }
        }
    }

    /// One server-side apply of `status` to the target's status
    /// subresource, fit for the API (see [`fit_for_the_api`]).
    pub async fn apply(
        &self,
        target: &ReportTarget,
        status: &SwapAttemptStatus,
    ) -> Result<(), ReportError> {
        let api: Api<SwapAttempt> = Api::namespaced(self.client.clone(), &target.namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let mut status = status.clone();
        fit_for_the_api(&mut status, target.observed_generation);
        let body = apply_body(&status);
        let started = Instant::now();
        let written = tokio::time::timeout(
            REQUEST_TIMEOUT,
            api.patch_status(&target.name, &params, &Patch::Apply(&body)),
        )
        .await;
        match written {
            Ok(Ok(_)) => {
                tracing::debug!(attempt = %target, took_ms = started.elapsed().as_millis() as u64, "status written");
                Ok(())
            }
            Ok(Err(source)) => Err(ReportError::Api {
                target: target.to_string(),
                source,
            }),
            Err(_) => Err(ReportError::Timeout {
                target: target.to_string(),
            }),
        }
    }

    /// Drops an accepted outcome from the journal. A failure is logged: the
    /// outcome is then delivered again after a restart, which is harmless.
    async fn acknowledge(&self, target: &ReportTarget) {
        let Some(instance) = target.instance.clone() else {
            return;
        };
        let ledger = Arc::clone(&self.ledger);
        let sched_rev = target.sched_rev;
        let acknowledged =
            tokio::task::spawn_blocking(move || ledger.acknowledge(&instance, sched_rev)).await;
        match acknowledged {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::error!(
                attempt = %target,
                error = %error_chain(&error),
                "the outcome was accepted but the journal could not drop it; it will be written again after a restart"
            ),
            Err(error) => {
                tracing::error!(attempt = %target, %error, "acknowledging an outcome panicked")
            }
        }
    }
}

/// Counts one outcome in the backlog gauge for as long as it lives.
struct BacklogEntry<'a>(&'a AgentMetrics);

impl<'a> BacklogEntry<'a> {
    fn new(metrics: &'a AgentMetrics) -> Self {
        metrics.backlog_added();
        Self(metrics)
    }
}

impl Drop for BacklogEntry<'_> {
    fn drop(&mut self) {
        self.0.backlog_removed();
    }
}

/// An error and its sources as one line.
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
