//! The reconcile of one InstanceGeneration: read the caches, plan (pure),
//! apply the plan, from the [`Context`] every reconcile shares.

use std::sync::Arc;
use std::time::{Duration, Instant};

use genswap_crds::{InstanceGeneration, SwapAttempt};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Resource, ResourceExt};
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::apply::{self, Applied, ApplyError};
use crate::context::Context;
use crate::events::Queued;
use crate::expectations::CaughtUp;
use crate::metrics::Deferral;
use crate::observe::{self, WatchedIg};

/// How long a healthy InstanceGeneration waits before it is planned again
/// with no event at all: a safety net under the watches.
pub const RESYNC_PERIOD: Duration = Duration::from_secs(10 * 60);

/// How soon to look again when the caches have not yet caught up with this
/// replica's own writes (the watch event normally comes first and wakes the
/// reconcile sooner).
pub const CATCH_UP_RETRY: Duration = Duration::from_secs(1);

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
        ctx.step_down(ig);
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
    let now = (ctx.clock)();
    let plan = (ctx.planner)(ig, &attempts, &nodes, now, ctx.revisions(ig));
    let (plan, verdict) = genswap_runtime::prometheus::measure_plan(
        plan,
        ctx.prometheus.as_ref(),
        "the controller has no Prometheus to ask (--prometheus-url, the chart's controller.prometheusURL)",
        ig,
        &Time(now),
        |measured| (ctx.planner)(measured, &attempts, &nodes, now, ctx.revisions(ig)),
    )
    .await;
    if let Some(verdict) = &verdict {
        ctx.metrics.analysis_measured(verdict);
    }
    // Copies of the cache, built for the plan: applying it can take
    // minutes (a release's creates are paced across every reconcile), and
    // with every IG's copies held that long they were most of the peak.
    drop((attempts, nodes));
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
    if !ctx.leadership.term_seeded() {
        // The term's list re-plans nothing by itself: this IG looks again.
        debug!(ig = %ig.name_any(), "new term: the attempts are still being listed; waiting");
        ctx.metrics.plan_deferred(Deferral::TermNotSeeded);
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
        CaughtUp::RecordsUnseen { missing } => {
            // A plan now would read those nodes' older records and announce
            // their outcomes again; the watch event of each patch wakes it.
            debug!(ig = %ig.name_any(), ?missing, "attempt cache behind our own record writes; waiting for it");
            ctx.metrics.plan_deferred(Deferral::OwnRecordUnseen);
            Some(Action::requeue(CATCH_UP_RETRY))
        }
        CaughtUp::GaveUp { missing } => confirm_missing(ig, ctx, &missing).await,
    }
}

/// Asks the API server about attempts the cache has not shown for a whole
/// patience: those it holds are waited for again (the watch is behind, and
/// a plan now would issue their nodes twice); planning goes on only when it
/// holds none of them.
async fn confirm_missing(
    ig: &InstanceGeneration,
    ctx: &Context,
    missing: &[String],
) -> Option<Action> {
    let name = ig.name_any();
    let api: Api<SwapAttempt> =
        Api::namespaced(ctx.client.clone(), &ig.namespace().unwrap_or_default());
    match crate::term::stored_among(&api, &name, missing).await {
        Ok(stored) if stored.is_empty() => {
            warn!(
                ig = %name,
                ?missing,
                "attempts this replica created, or listed at the start of its term, never reached its cache and the API server holds none of them; planning without them"
            );
            None
        }
        Ok(stored) => {
            warn!(
                ig = %name,
                ?stored,
                "the API server holds attempts this replica's cache has not shown for a whole patience; waiting for the watch"
            );
            for attempt in &stored {
                ctx.note_created(ig, attempt);
            }
            ctx.metrics.plan_deferred(Deferral::CacheBehindServer);
            Some(Action::requeue(CATCH_UP_RETRY))
        }
        Err(error) => {
            warn!(ig = %name, %error, ?missing, "cannot tell whether attempts the cache never showed exist; not planning");
            for attempt in missing {
                ctx.note_created(ig, attempt);
            }
            ctx.metrics.plan_deferred(Deferral::CacheBehindServer);
            Some(Action::requeue(CATCH_UP_RETRY))
        }
    }
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
