//! The write side of a reconcile: applies a [`Plan`] to the API server in the
//! order that keeps a revision from ever being issued twice.
//!
//! 0. the node records that changed, each by a merge patch of one
//!    annotation on the node's carrying attempt: an outcome is recorded
//!    there before its Event goes out, and a record that fails to land is
//!    derived again by the next plan (its Event may then come twice);
//! 1. status, by server-side apply on `/status` carrying the object's
//!    resourceVersion: the write is the reservation of `status.schedRev`, and
//!    a 409 means another writer got there first, so nothing is created. A
//!    status that only records progress may be put off
//!    ([`StatusWrite::PutOff`]); a reservation never is;
//! 2. the SwapAttempts, only after the reservation stands, or from revisions
//!    this replica reserved earlier and has not issued (a create that
//!    fails burns its revision; the next plan issues a higher one);
//! 3. deletions of old attempts;
//! 4. Events on the InstanceGeneration, queued for [`crate::events`] to
//!    write after the reconcile (they are not on its critical path).
//!
//! Leadership is checked right before every request (before the plan's
//! creates, which go out together), so a replica that loses the Lease
//! mid-way sends nothing more.

use std::collections::HashSet;
use std::future::Future;

use genswap_crds::{
    ANNOTATION_RECORD, ConditionType, InstanceGeneration, InstanceGenerationStatus, SwapAttempt,
};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};
use thiserror::Error;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::context::Context;
use crate::events::Queued;
use crate::leader::Leadership;
use genswap_core::scheduler::{OwnReservation, Plan, PlanEvent, RecordWrite};

/// Reason of the Warning recorded when an attempt could not be created.
pub const REASON_CREATE_FAILED: &str = "AttemptCreateFailed";

/// Why a plan could not be applied in full.
#[derive(Debug, Error)]
pub enum ApplyError {
    #[error("{name} has no resourceVersion; refusing an unconditional status write")]
    MissingResourceVersion { name: String },
    #[error("{name} has no namespace")]
    MissingNamespace { name: String },
    #[error(
        "plan lowers status.schedRev of {name} from {previous} to {planned}; a revision must never be reissued"
    )]
    RevisionWentBackwards {
        name: String,
        previous: i64,
        planned: i64,
    },
    #[error(
        "plan creates {attempt} with schedRev {sched_rev}, outside the reserved range ({previous}, {reserved}]"
    )]
    RevisionNotReserved {
        attempt: String,
        sched_rev: i64,
        previous: i64,
        reserved: i64,
    },
    #[error("plan creates two attempts with schedRev {sched_rev}")]
    DuplicateRevision { sched_rev: i64 },
    #[error("plan reserves status.schedRev {planned} of {name} but its status write was put off")]
    ReservationPutOff { name: String, planned: i64 },
    #[error(
        "reserving status.schedRev of {name} at resourceVersion {resource_version} conflicted; nothing was created"
    )]
    ReservationConflict {
        name: String,
        resource_version: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing the status of {name} failed; nothing was created")]
    StatusWrite {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("creating SwapAttempt {attempt} (schedRev {sched_rev}) failed; the revision is burned")]
    Create {
        attempt: String,
        sched_rev: i64,
        #[source]
        source: kube::Error,
    },
    #[error("writing the node record onto SwapAttempt {attempt} failed")]
    Record {
        attempt: String,
        #[source]
        source: kube::Error,
    },
    #[error("deleting SwapAttempt {attempt} failed")]
    Delete {
        attempt: String,
        #[source]
        source: kube::Error,
    },
}

impl ApplyError {
    /// A short, fixed label for the `error` label of the error metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            ApplyError::MissingResourceVersion { .. } | ApplyError::MissingNamespace { .. } => {
                "incomplete_object"
            }
            ApplyError::RevisionWentBackwards { .. }
            | ApplyError::RevisionNotReserved { .. }
            | ApplyError::DuplicateRevision { .. }
            | ApplyError::ReservationPutOff { .. } => "plan_invariant",
            ApplyError::ReservationConflict { .. } => "conflict",
            ApplyError::StatusWrite { .. } => "status_write",
            ApplyError::Create { .. } => "create",
            ApplyError::Record { .. } => "record",
            ApplyError::Delete { .. } => "delete",
        }
    }

    /// A create that failed without a refusal: no answer came, or the
    /// server failed (a 5xx, a timeout on its side), so the object may have
    /// been stored. A 4xx (429, 403, 422) says it was not.
    pub fn creation_unknown(&self) -> bool {
        match self {
            ApplyError::Create { source, .. } => match source {
                kube::Error::Api(status) => status.code >= 500,
                _ => true,
            },
            _ => false,
        }
    }
}

/// Whether the plan's status goes out now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusWrite {
    Now,
    /// Not written: a later plan derives it again. Only for a plan whose
    /// status may wait.
    PutOff,
}

/// The write that was next when leadership was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    Record,
    Status,
    Create,
    Delete,
    Event,
}

/// What applying a plan did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Every write was attempted.
    Complete(Summary),
    /// Leadership was lost before `next`; nothing from there on was sent.
    SteppedDown { next: Write, done: Summary },
}

/// Counts of the writes that succeeded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub records: usize,
    pub status_written: bool,
    pub created: usize,
    pub deleted: usize,
    pub events: usize,
}

/// Applies `plan` for `ig` (as the cache last saw it). Returns the first
/// create or delete failure after every write was tried and every Event
/// recorded; Event failures are logged and counted but do not fail it.
pub async fn apply_plan(
    ctx: &Context,
    ig: &InstanceGeneration,
    plan: &Plan,
    status_write: StatusWrite,
) -> Result<Applied, ApplyError> {
    let name = ig.name_any();
    let namespace = ig
        .namespace()
        .ok_or_else(|| ApplyError::MissingNamespace { name: name.clone() })?;
    let previous = ig.status.as_ref();
    let previous_rev = previous.map_or(0, |s| s.sched_rev);
    let own = ctx
        .own_reservation(ig)
        .filter(|own| own.reserved == previous_rev);
    check_revisions(&name, previous_rev, own, plan)?;
    let put_off = status_write == StatusWrite::PutOff;
    if put_off && plan.status.sched_rev != previous_rev {
        return Err(ApplyError::ReservationPutOff {
            name,
            planned: plan.status.sched_rev,
        });
    }

    let mut done = Summary::default();
    let mut failures = Vec::new();
    let attempts: Api<SwapAttempt> = Api::namespaced(ctx.client.clone(), &namespace);
    if !plan.records.is_empty() && !ctx.leadership.is_leader() {
        return Ok(stepped_down(Write::Record, done));
    }
    let written = paced(
        &ctx.create_permits,
        &ctx.leadership,
        &plan.records,
        |write| write_record(ctx, &attempts, write),
    )
    .await;
    let mut unsent = 0;
    for (write, result) in plan.records.iter().zip(written) {
        match result {
            Some(Ok(annotation)) => {
                ctx.note_record(ig, &write.attempt, annotation);
                done.records += 1;
                if let Some((outcome, mode)) = write.new_outcome {
                    ctx.metrics.outcome_recorded(outcome, mode);
                }
            }
            None => unsent += 1,
            Some(Err(error)) => failures.push(error),
        }
    }
    if unsent > 0 {
        return Ok(stepped_down(Write::Record, done));
    }
    let status_changed = match previous {
        Some(previous) => previous != &plan.status,
        None => plan.status != InstanceGenerationStatus::default(),
    };
    if put_off {
        debug!(%name, "status records only progress; put off");
    } else if status_changed {
        if !ctx.leadership.is_leader() {
            return Ok(stepped_down(Write::Status, done));
        }
        write_status(ctx, ig, &name, &namespace, &plan.status).await?;
        done.status_written = true;
        let (wave_started, deadline_exceeded) = rollout_milestones(previous, &plan.status);
        if wave_started {
            ctx.metrics.wave_started();
        }
        if deadline_exceeded {
            ctx.metrics.progress_deadline_exceeded();
        }
    } else {
        debug!(%name, "status unchanged; no write");
    }

    // The plan's creates go out together: each is its own reserved
    // revision, so none waits on another's round trip.
    if !plan.create.is_empty() && !ctx.leadership.is_leader() {
        return Ok(stepped_down(Write::Create, done));
    }
    // Issued, whether its create succeeds or burns it.
    let newest_created = plan.create.iter().map(|a| a.spec.sched_rev).max();
    if done.status_written && plan.status.sched_rev > previous_rev {
        ctx.note_reservation(
            ig,
            OwnReservation {
                issued: newest_created.unwrap_or(plan.status.sched_rev),
                reserved: plan.status.sched_rev,
            },
        );
    } else if let (Some(own), Some(issued)) = (own, newest_created) {
        ctx.note_reservation(ig, OwnReservation { issued, ..own });
    }
    let created = paced(
        &ctx.create_permits,
        &ctx.leadership,
        &plan.create,
        |attempt| create_attempt(&attempts, attempt, &ctx.field_manager),
    )
    .await;
    let mut unsent = 0;
    for (attempt, result) in plan.create.iter().zip(created) {
        match result {
            None => unsent += 1,
            Some(Ok(())) => {
                ctx.note_created(ig, &attempt.name_any());
                done.created += 1;
                ctx.metrics
                    .attempt_issued(attempt.spec.cause, attempt.spec.mode);
                info!(
                    ig = %name,
                    attempt = %attempt.name_any(),
                    node = %attempt.spec.node_name,
                    sched_rev = attempt.spec.sched_rev,
                    "attempt issued"
                );
            }
            Some(Err(error)) => {
                // No answer, or a server error: it may exist all the same,
                // and a plan that cannot see it would issue the node again.
                if error.creation_unknown() {
                    ctx.note_created(ig, &attempt.name_any());
                }
                failures.push(error);
            }
        }
    }
    if unsent > 0 {
        // Leadership went while they waited for a permit: never sent, their
        // revisions are unused, and the next leader plans from the server.
        debug!(ig = %name, unsent, "stepped down with creates still queued");
        return Ok(stepped_down(Write::Create, done));
    }
    // Together too, paced as the creates: a release replaces an attempt
    // on every node, and one at a time they outlasted the rollout.
    if !plan.delete.is_empty() && !ctx.leadership.is_leader() {
        return Ok(stepped_down(Write::Delete, done));
    }
    let to_delete = ctx.still_to_delete(ig, &plan.delete);
    let deleted = paced(
        &ctx.create_permits,
        &ctx.leadership,
        &to_delete,
        |attempt| delete_attempt(&attempts, attempt),
    )
    .await;
    let mut unsent = 0;
    for (result, name) in deleted.into_iter().zip(&to_delete) {
        match result {
            Some(Ok(())) => {
                ctx.note_deleted(ig, name);
                done.deleted += 1;
            }
            None => unsent += 1,
            Some(Err(error)) => failures.push(error),
        }
    }
    if unsent > 0 {
        return Ok(stepped_down(Write::Delete, done));
    }

    let regarding = ig.object_ref(&());
    let failure_events: Vec<PlanEvent> = failures
        .iter()
        .filter_map(|failure| match failure {
            ApplyError::Create {
                attempt,
                sched_rev,
                source,
            } => Some(PlanEvent {
                warning: true,
                reason: REASON_CREATE_FAILED.to_string(),
                message: if failure.creation_unknown() {
                    format!(
                        "SwapAttempt {attempt} (schedRev {sched_rev}) may not have been created: \
                         {source}; the next plan waits until the attempt cache shows it, or \
                         for {}s, then issues a higher revision if it is not there",
                        crate::expectations::PATIENCE.as_secs()
                    )
                } else {
                    format!(
                        "SwapAttempt {attempt} (schedRev {sched_rev}) was not created: {source}; \
                         the revision is burned and the next reconcile issues a higher one"
                    )
                },
            }),
            _ => None,
        })
        .collect();
    // An Event goes out when it is first planned; while the status that
    // records it is put off, later plans derive it again.
    let fresh = ctx.events_not_yet_recorded(ig, &plan.events, put_off);
    for event in fresh.iter().chain(&failure_events) {
        if !ctx.leadership.is_leader() {
            return Ok(stepped_down(Write::Event, done));
        }
        let queued = Queued {
            warning: event.warning,
            reason: event.reason.clone(),
            note: event.message.clone(),
            regarding: regarding.clone(),
        };
        if ctx.events.record(queued) {
            done.events += 1;
        } else {
            ctx.metrics.reconcile_failed("event_queue_full");
            warn!(ig = %name, reason = %event.reason, "the Event queue is full; dropping an Event");
        }
    }

    let mut failures = failures.into_iter();
    match failures.next() {
        None => Ok(Applied::Complete(done)),
        Some(first) => {
            for other in failures {
                warn!(ig = %name, error = %other, "write failed");
            }
            Err(first)
        }
    }
}

fn stepped_down(next: Write, done: Summary) -> Applied {
    info!(?next, "not the leader any more; stopped writing");
    Applied::SteppedDown { next, done }
}

/// Refuses a plan that would reissue a revision: the adapter is the last
/// line before the API server, so it checks the scheduler's promise. An
/// attempt's revision is above what the status reserved before, or within
/// what this replica reserved itself and has not issued (`own`, still the
/// status's `schedRev`).
fn check_revisions(
    name: &str,
    previous: i64,
    own: Option<OwnReservation>,
    plan: &Plan,
) -> Result<(), ApplyError> {
    let reserved = plan.status.sched_rev;
    if reserved < previous {
        return Err(ApplyError::RevisionWentBackwards {
            name: name.to_string(),
            previous,
            planned: reserved,
        });
    }
    let lowest_free = own.map_or(previous, |own| own.issued.min(previous));
    let mut seen = HashSet::new();
    for attempt in &plan.create {
        let sched_rev = attempt.spec.sched_rev;
        if sched_rev <= lowest_free || sched_rev > reserved {
            return Err(ApplyError::RevisionNotReserved {
                attempt: attempt.name_any(),
                sched_rev,
                previous: lowest_free,
                reserved,
            });
        }
        if !seen.insert(sched_rev) {
            return Err(ApplyError::DuplicateRevision { sched_rev });
        }
    }
    Ok(())
}

/// The server-side apply body for `/status`. `resourceVersion` makes the
/// apply conditional: it fails with 409 unless the object is still the one
/// the plan was made from.
pub fn status_apply_patch(
    name: &str,
    resource_version: &str,
    status: &InstanceGenerationStatus,
) -> Value {
    let resource = InstanceGeneration::api_version(&());
    json!({
        "apiVersion": resource,
        "kind": InstanceGeneration::kind(&()),
        "metadata": { "name": name, "resourceVersion": resource_version },
        "status": status,
    })
}

async fn write_status(
    ctx: &Context,
    ig: &InstanceGeneration,
    name: &str,
    namespace: &str,
    status: &InstanceGenerationStatus,
) -> Result<(), ApplyError> {
    let resource_version =
        ig.resource_version()
            .ok_or_else(|| ApplyError::MissingResourceVersion {
                name: name.to_string(),
            })?;
    let body = status_apply_patch(name, &resource_version, status);
    // Force: status belongs to the controller alone, so a 409 can only mean
    // the resourceVersion moved, never a field-ownership dispute.
    let params = PatchParams::apply(&ctx.field_manager).force();
    let igs: Api<InstanceGeneration> = Api::namespaced(ctx.client.clone(), namespace);
    match igs.patch_status(name, &params, &Patch::Apply(&body)).await {
        Ok(_) => {
            ctx.note_replaced(ig);
            Ok(())
        }
        Err(kube::Error::Api(failure)) if failure.is_conflict() => {
            Err(ApplyError::ReservationConflict {
                name: name.to_string(),
                resource_version,
                source: kube::Error::Api(failure),
            })
        }
        Err(source) => Err(ApplyError::StatusWrite {
            name: name.to_string(),
            source,
        }),
    }
}

/// Sends `write` for every item together, each once one of the shared
/// permits is free ([`crate::context::CREATES_AT_ONCE`]: creates, records
/// and deletes are all writes of attempts, and a release sends thousands of
/// each), and only if this replica still leads then. An item whose permit
/// came after leadership went is not sent: `None`, in the items' order.
async fn paced<'i, I, T, W, F>(
    permits: &Semaphore,
    leadership: &Leadership,
    items: &'i [I],
    write: W,
) -> Vec<Option<Result<T, ApplyError>>>
where
    W: Fn(&'i I) -> F,
    F: Future<Output = Result<T, ApplyError>>,
{
    futures::future::join_all(items.iter().map(|item| {
        let sent = write(item);
        async move {
            // The semaphore is never closed; without a permit the write goes all the same.
            let _permit = permits.acquire().await.ok();
            if !leadership.is_leader() {
                return None;
            }
            Some(sent.await)
        }
    }))
    .await
}

/// Writes a node record. Returns the annotation written; an attempt gone
/// meanwhile is no failure (its node's record goes onto a newer attempt).
async fn write_record(
    ctx: &Context,
    api: &Api<SwapAttempt>,
    write: &RecordWrite,
) -> Result<String, ApplyError> {
    let annotation = write.record.to_annotation();
    let body = record_patch(&annotation);
    let params = PatchParams {
        field_manager: Some(ctx.field_manager.clone()),
        ..PatchParams::default()
    };
    // Metadata only: the answer is the attempt's metadata, not all of it.
    match api
        .patch_metadata(&write.attempt, &params, &Patch::Merge(&body))
        .await
    {
        Ok(_) => Ok(annotation),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(annotation),
        Err(source) => Err(ApplyError::Record {
            attempt: write.attempt.clone(),
            source,
        }),
    }
}

/// The merge patch that sets an attempt's record annotation and touches
/// nothing else (the agent owns its status; labels and owner stay).
pub fn record_patch(annotation: &str) -> Value {
    json!({ "metadata": { "annotations": { ANNOTATION_RECORD: annotation } } })
}

/// Deletes an old attempt. One already gone counts as deleted.
async fn delete_attempt(api: &Api<SwapAttempt>, attempt: &str) -> Result<(), ApplyError> {
    match api.delete(attempt, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.is_not_found() => Ok(()),
        Err(source) => Err(ApplyError::Delete {
            attempt: attempt.to_string(),
            source,
        }),
    }
}

async fn create_attempt(
    api: &Api<SwapAttempt>,
    attempt: &SwapAttempt,
    field_manager: &str,
) -> Result<(), ApplyError> {
    // Named, so managedFields say who owns the spec rather than `unknown`.
    let params = PostParams {
        field_manager: Some(field_manager.to_string()),
        ..PostParams::default()
    };
    match api.create(&params, attempt).await {
        Ok(_) => Ok(()),
        // Only a lost response of our own earlier create can leave it there:
        // the revision in its name was never reserved twice.
        Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(()),
        Err(source) => Err(ApplyError::Create {
            attempt: attempt.name_any(),
            sched_rev: attempt.spec.sched_rev,
            source,
        }),
    }
}

/// Whether writing `next` over `previous` starts a rollout wave (one whose
/// nodes go, not one that bakes), and whether it turns the rollout Stalled
/// past its progress deadline: counted once the status says so.
fn rollout_milestones(
    previous: Option<&InstanceGenerationStatus>,
    next: &InstanceGenerationStatus,
) -> (bool, bool) {
    let going = |status: &InstanceGenerationStatus| {
        status
            .rollout
            .as_ref()
            .filter(|rollout| rollout.baking_until.is_none())
            .and_then(|rollout| rollout.wave_index)
    };
    let past_deadline = |status: &InstanceGenerationStatus| {
        genswap_crds::conditions::true_reason(&status.conditions, ConditionType::Stalled)
            == Some(genswap_core::scheduler::reasons::PROGRESS_DEADLINE_EXCEEDED)
    };
    let wave = going(next);
    (
        wave.is_some() && wave != previous.and_then(going),
        past_deadline(next) && !previous.is_some_and(past_deadline),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::metrics::Metrics;

    /// Counts the writes in flight and the most seen at once; each write
    /// stays in flight until `release` lets every held write finish.
    #[derive(Default)]
    struct InFlight {
        now: AtomicUsize,
        most: AtomicUsize,
        sent: AtomicUsize,
    }

    impl InFlight {
        async fn write(
            &self,
            release: &tokio::sync::watch::Receiver<bool>,
        ) -> Result<(), ApplyError> {
            let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            self.sent.fetch_add(1, Ordering::SeqCst);
            let mut release = release.clone();
            // The sender lives until every write is done.
            let _ = release.wait_for(|go| *go).await;
            self.now.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
    }

    fn leader() -> Leadership {
        let leadership = Leadership::follower(Arc::new(Metrics::new()));
        leadership.set(true);
        leadership
    }

    #[tokio::test]
    async fn writes_go_out_no_more_at_once_than_there_are_permits() {
        let permits = Semaphore::new(3);
        let leadership = leader();
        let in_flight = InFlight::default();
        let (go, release) = tokio::sync::watch::channel(false);
        let items: Vec<usize> = (0..20).collect();
        let all = paced(&permits, &leadership, &items, |_| in_flight.write(&release));
        let watcher = async {
            // Let the first writes take every permit, then let them all finish.
            while in_flight.now.load(Ordering::SeqCst) < 3 {
                tokio::task::yield_now().await;
            }
            go.send_replace(true);
        };
        let (results, ()) = tokio::join!(all, watcher);
        assert_eq!(results.len(), 20);
        assert!(results.iter().all(|r| matches!(r, Some(Ok(())))));
        assert_eq!(in_flight.sent.load(Ordering::SeqCst), 20);
        assert_eq!(in_flight.most.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn writes_still_waiting_for_a_permit_when_leadership_goes_are_not_sent() {
        let permits = Semaphore::new(2);
        let leadership = leader();
        let in_flight = InFlight::default();
        let (go, release) = tokio::sync::watch::channel(false);
        let items: Vec<usize> = (0..10).collect();
        let all = paced(&permits, &leadership, &items, |_| in_flight.write(&release));
        let stepper = async {
            while in_flight.now.load(Ordering::SeqCst) < 2 {
                tokio::task::yield_now().await;
            }
            leadership.set(false);
            go.send_replace(true);
        };
        let (results, ()) = tokio::join!(all, stepper);
        let sent = results.iter().filter(|r| matches!(r, Some(Ok(())))).count();
        let unsent = results.iter().filter(|r| r.is_none()).count();
        assert_eq!((sent, unsent), (2, 8));
        assert_eq!(in_flight.sent.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn the_record_patch_sets_one_annotation_and_nothing_else() {
        let body = record_patch("{\"node\":{\"name\":\"n1\"}}");
        assert_eq!(
            body,
            json!({"metadata": {"annotations": {"genswap.dev/record": "{\"node\":{\"name\":\"n1\"}}"}}})
        );
    }

    #[test]
    fn the_status_patch_carries_the_resource_version() {
        let status = InstanceGenerationStatus {
            sched_rev: 7,
            ..Default::default()
        };
        let body = status_apply_patch("web", "42", &status);
        assert_eq!(body["apiVersion"], "genswap.dev/v1alpha1");
        assert_eq!(body["kind"], "InstanceGeneration");
        assert_eq!(body["metadata"]["resourceVersion"], "42");
        assert_eq!(body["status"]["schedRev"], 7);
    }

    #[test]
    fn a_wave_and_a_passed_deadline_count_once_when_the_status_first_says_so() {
        use genswap_crds::RolloutStatus;
        let at = |wave: Option<i32>, baking: bool| InstanceGenerationStatus {
            rollout: Some(RolloutStatus {
                wave_index: wave,
                baking_until: baking.then_some(
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                        k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                    ),
                ),
                ..RolloutStatus::default()
            }),
            ..InstanceGenerationStatus::default()
        };
        assert_eq!(rollout_milestones(None, &at(Some(0), false)), (true, false));
        assert_eq!(
            rollout_milestones(Some(&at(Some(0), false)), &at(Some(0), false)),
            (false, false)
        );
        assert_eq!(
            rollout_milestones(Some(&at(Some(0), false)), &at(Some(0), true)),
            (false, false)
        );
        assert_eq!(
            rollout_milestones(Some(&at(Some(0), true)), &at(Some(1), false)),
            (true, false)
        );
        assert_eq!(
            rollout_milestones(Some(&at(Some(1), false)), &at(None, false)),
            (false, false)
        );

        let mut stalled = at(Some(1), false);
        genswap_crds::set_condition(
            &mut stalled.conditions,
            genswap_crds::ConditionType::Stalled,
            true,
            genswap_core::scheduler::reasons::PROGRESS_DEADLINE_EXCEEDED,
            "no progress",
            None,
            &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
        );
        assert_eq!(
            rollout_milestones(Some(&at(Some(1), false)), &stalled),
            (false, true)
        );
        assert_eq!(rollout_milestones(Some(&stalled), &stalled), (false, false));
    }
}
