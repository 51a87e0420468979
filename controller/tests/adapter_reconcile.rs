//! The reconcile against a mocked API server: each test states the exact
//! requests, in order, and the reconcile's result. The plan is fixed, so these
//! tests exercise the adapter alone; `adapter_end_to_end.rs` runs the real
//! scheduler.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use genswap_controller::cache_sync::{Cache, CacheSync};
use genswap_controller::context::Planner;
use genswap_controller::metrics::Metrics;
use genswap_controller::reconciler::{
    CATCH_UP_RETRY, RESYNC_PERIOD, backoff_delay, error_policy, reconcile,
};
use genswap_core::scheduler::{Plan, RecordWrite};
use genswap_crds::{
    ANNOTATION_RECORD, InstanceGeneration, InstanceGenerationStatus, Mode, NodeGeneration,
    NodeRecord, Outcome, SwapAttempt,
};
use http::StatusCode;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::core::DeserializeGuard;
use kube::core::error_boundary::InvalidObject;
use kube::runtime::controller::Action;
use support::*;

fn issuing_plan() -> Plan {
    Plan {
        create: vec![attempt("n1", 5)],
        delete: Vec::new(),
        status: status(5),
        events: vec![event(
            false,
            "AttemptIssued",
            "schedRev 5 on n1 (install, overlap)",
        )],
        ..Plan::default()
    }
}

#[tokio::test]
async fn a_reconcile_does_not_wait_for_its_events() {
    let plan = issuing_plan();
    let (h, verifier) = harness(fixed_planner(plan.clone()), true);
    let (release, released) = tokio::sync::oneshot::channel();
    let scenario = verifier.run(Scenario::EventHeld {
        ig: ig("100", Some(status(4))),
        plan,
        released,
    });
    // The API server has not answered the Event: the reconcile is done all
    // the same, its attempt created.
    let action = tokio::time::timeout(
        DEADLINE,
        reconcile(watched(ig("100", Some(status(4)))), h.ctx.clone()),
    )
    .await
    .expect("the reconcile ends while its Event is unanswered")
    .expect("reconcile succeeds");
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    let _ = release.send(());
    drop(h.ctx);
    finish(scenario).await;
}

fn metric_line(metrics: &Metrics, line: &str) -> bool {
    metrics
        .encode()
        .expect("metrics encode")
        .lines()
        .any(|l| l == line)
}

/// Reconciles `ig` with a planner that returns `plan`, against a server
/// that expects exactly the writes of `plan` in order and accepts them;
/// returns the reconcile's action and the metrics.
async fn apply_fixed(ig: InstanceGeneration, plan: Plan) -> (Action, Arc<Metrics>) {
    let (h, verifier) = harness(fixed_planner(plan.clone()), true);
    let scenario = verifier.run(Scenario::Apply {
        ig: ig.clone(),
        plan,
    });
    let action = reconcile(watched(ig), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    let metrics = h.metrics.clone();
    drop(h.ctx);
    finish(scenario).await;
    (action, metrics)
}

#[tokio::test]
async fn issuing_an_attempt_reserves_the_revision_before_creating_it() {
    let (action, metrics) = apply_fixed(ig("100", Some(status(4))), issuing_plan()).await;
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    assert!(
        metric_line(
            &metrics,
            "genswap_controller_attempts_issued_total{cause=\"install\",mode=\"overlap\"} 1"
        ),
        "the issued attempt is counted"
    );
}

#[tokio::test]
async fn a_cache_still_behind_our_own_write_is_not_planned_from() {
    let (h, verifier) = harness(fixed_planner(issuing_plan()), true);
    let ig = ig("100", Some(status(4)));
    let scenario = verifier.run(Scenario::Apply {
        ig: ig.clone(),
        plan: issuing_plan(),
    });
    reconcile(watched(ig.clone()), h.ctx.clone())
        .await
        .expect("the first reconcile issues");
    // The same version again: our own write replaced it, so planning from
    // it could only conflict. Nothing is sent; it looks again soon.
    let action = reconcile(watched(ig), h.ctx.clone())
        .await
        .expect("waiting for the cache is not an error");
    assert_eq!(action, Action::requeue(CATCH_UP_RETRY));
    drop(h.ctx);
    finish(scenario).await;
}

/// A planner that hands out `plans` in turn (the last one from then on)
/// and counts how often it was consulted.
fn counting_planner(plans: Vec<Plan>) -> (Planner, Arc<Mutex<usize>>) {
    let calls = Arc::new(Mutex::new(0));
    let counter = calls.clone();
    let planner: Planner = Arc::new(move |_: &_, _: &[_], _: &[_], _, _| {
        let mut calls = counter.lock().expect("counter lock");
        let plan = plans[(*calls).min(plans.len() - 1)].clone();
        *calls += 1;
        plan
    });
    (planner, calls)
}

fn calls(counter: &Arc<Mutex<usize>>) -> usize {
    *counter.lock().expect("counter lock")
}

/// A reconcile of `ig` waits for the attempt cache without consulting the
/// planner; once `shown` lands in the cache, the next one plans.
async fn waits_until_the_cache_shows(
    h: &mut Harness,
    ig: InstanceGeneration,
    shown: SwapAttempt,
    planned: &Arc<Mutex<usize>>,
) {
    let before = calls(planned);
    let action = reconcile(watched(ig.clone()), h.ctx.clone())
        .await
        .expect("waiting for the cache is not an error");
    assert_eq!(action, Action::requeue(CATCH_UP_RETRY));
    assert_eq!(calls(planned), before, "the planner was not consulted");
    h.add_attempt(shown);
    let action = reconcile(watched(ig), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    assert_eq!(
        calls(planned),
        before + 1,
        "planned once the cache caught up"
    );
}

#[tokio::test]
async fn a_cache_without_our_own_create_is_not_planned_from() {
    let settled = Plan {
        status: status(5),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![issuing_plan(), settled]);
    let (mut h, verifier) = harness(planner, true);
    let scenario = verifier.run(Scenario::Apply {
        ig: ig("100", Some(status(4))),
        plan: issuing_plan(),
    });
    reconcile(watched(ig("100", Some(status(4)))), h.ctx.clone())
        .await
        .expect("the first reconcile issues web-n1-5");

    // The watch brought our status write back before our create: the IG
    // says schedRev 5, the attempt cache has nothing. Planning now would
    // give n1 a second attempt for the same desired state; the create's
    // watch event lands, and planning resumes.
    waits_until_the_cache_shows(&mut h, ig_at("101", status(5)), attempt("n1", 5), &planned).await;
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_plans_deferred_total{reason=\"own_create_unseen\"} 1"
    ));
    drop(h.ctx);
    finish(scenario).await;
}

/// n1's attempt 5 ended `done`: its record goes onto it, before the status.
fn recording_plan() -> Plan {
    let mut node = NodeGeneration::fresh("n1");
    node.build = Some("b1".into());
    Plan {
        records: vec![RecordWrite {
            attempt: "web-n1-5".into(),
            record: NodeRecord {
                node,
                held_down: Vec::new(),
            },
            new_outcome: Some((Outcome::Done, Mode::Overlap)),
        }],
        status: status(5),
        events: vec![event(false, "SwapDone", "node n1: rev 5 done")],
        ..Plan::default()
    }
}

#[tokio::test]
async fn a_record_is_written_before_the_status_and_waited_for_before_the_next_plan() {
    let settled = Plan {
        status: status(5),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![recording_plan(), settled]);
    let (mut h, verifier) = harness(planner, true);
    h.add_attempt(attempt("n1", 5));
    let scenario = verifier.run(Scenario::Apply {
        ig: ig("100", Some(status(4))),
        plan: recording_plan(),
    });
    reconcile(watched(ig("100", Some(status(4)))), h.ctx.clone())
        .await
        .expect("the first reconcile records n1's outcome");
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_outcomes_total{outcome=\"done\",mode=\"overlap\"} 1"
    ));

    // The status came back, the record not yet: a plan now would read n1's
    // older record and announce its outcome again.
    let mut recorded = attempt("n1", 5);
    recorded.metadata.annotations = Some(
        [(
            ANNOTATION_RECORD.to_string(),
            recording_plan().records[0].record.to_annotation(),
        )]
        .into(),
    );
    waits_until_the_cache_shows(&mut h, ig_at("101", status(5)), recorded, &planned).await;
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_plans_deferred_total{reason=\"own_record_unseen\"} 1"
    ));
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test(start_paused = true)]
async fn planning_waits_for_the_attempt_and_node_caches_first_list() {
    let settled = Plan {
        status: status(4),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![settled]);
    let caches = CacheSync::new();
    // kube-runtime starts reconciling once the IG cache alone is ready.
    caches.mark(Cache::InstanceGenerations);
    let (h, verifier) = harness_with_caches(planner, true, caches.clone());
    let scenario = verifier.run(Scenario::RadioSilence);

    // Neither cache ever lists: the reconcile gives up its slot and retries.
    let action = reconcile(watched(ig("100", Some(status(4)))), h.ctx.clone())
        .await
        .expect("waiting for the caches is not an error");
    assert_eq!(action, Action::requeue(CATCH_UP_RETRY));
    assert_eq!(calls(&planned), 0, "nothing planned from empty caches");
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_plans_deferred_total{reason=\"caches_syncing\"} 1"
    ));

    // The caches list while a reconcile waits: it plans at once.
    let waiting = tokio::spawn(reconcile(
        watched(ig("100", Some(status(4)))),
        h.ctx.clone(),
    ));
    tokio::task::yield_now().await;
    caches.mark(Cache::SwapAttempts);
    caches.mark(Cache::Nodes);
    let action = waiting
        .await
        .expect("reconcile task ran")
        .expect("reconcile succeeds");
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    assert_eq!(calls(&planned), 1);
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn a_conflict_on_the_reservation_creates_nothing_and_is_requeued_with_backoff() {
    let (h, verifier) = harness(fixed_planner(issuing_plan()), true);
    let ig = ig("100", Some(status(4)));
    let scenario = verifier.run(Scenario::ReservationConflict {
        ig: ig.clone(),
        plan: issuing_plan(),
    });
    let object = watched(ig);
    let error = reconcile(object.clone(), h.ctx.clone())
        .await
        .expect_err("a lost reservation fails the reconcile");
    assert_eq!(error.metric_label(), "conflict");
    assert_eq!(
        error_policy(object.clone(), &error, h.ctx.clone()),
        Action::requeue(backoff_delay(1))
    );
    assert_eq!(
        error_policy(object, &error, h.ctx.clone()),
        Action::requeue(backoff_delay(2)),
        "consecutive failures back off further"
    );
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_reconcile_errors_total{error=\"conflict\"} 2"
    ));
    assert!(
        !h.metrics
            .encode()
            .expect("metrics encode")
            .contains("attempts_issued_total{"),
        "nothing was issued"
    );
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn an_unchanged_status_is_not_written() {
    let current = InstanceGenerationStatus {
        ready: Some("3/3".into()),
        ..status(9)
    };
    let plan = Plan {
        status: current.clone(),
        requeue_after: Some(Duration::from_secs(7)),
        ..Plan::default()
    };
    let (h, verifier) = harness(fixed_planner(plan), true);
    let scenario = verifier.run(Scenario::RadioSilence);
    let action = reconcile(watched(ig("100", Some(current))), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(7)),
        "the plan's requeue is honoured"
    );
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn a_changed_status_is_written_alone_when_nothing_is_issued() {
    let plan = Plan {
        status: InstanceGenerationStatus {
            ready: Some("1/3".into()),
            ..status(9)
        },
        ..Plan::default()
    };
    apply_fixed(ig("100", Some(status(9))), plan).await;
}

#[tokio::test]
async fn events_are_recorded_with_their_reasons_and_types_after_the_deletes() {
    let plan = Plan {
        create: vec![attempt("n1", 8), attempt("n2", 9)],
        delete: vec!["web-n1-2".into(), "web-n2-3".into()],
        status: status(9),
        events: vec![
            event(false, "SwapDone", "n3 serves b1 as generation 4"),
            event(true, "BuildFailed", "b1 failed health on n4: 500"),
            event(false, "AttemptIssued", "schedRev 8 on n1"),
            event(false, "AttemptIssued", "schedRev 9 on n2"),
        ],
        ..Plan::default()
    };
    apply_fixed(ig("100", Some(status(7))), plan).await;
}

#[tokio::test]
async fn events_alone_are_recorded_without_any_other_write() {
    let current = status(3);
    let events = vec![event(true, "NodeDown", "n2: nothing serves")];
    let plan = Plan {
        status: current.clone(),
        events: events.clone(),
        ..Plan::default()
    };
    let (h, verifier) = harness(fixed_planner(plan), true);
    let scenario = verifier.run(Scenario::EventsOnly { events });
    reconcile(watched(ig("100", Some(current))), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn a_follower_sends_nothing_and_does_not_plan() {
    let planned = Arc::new(Mutex::new(0));
    let counter = planned.clone();
    let planner = Arc::new(move |_: &_, _: &[_], _: &[_], _, _| {
        *counter.lock().expect("counter lock") += 1;
        issuing_plan()
    });
    let (h, verifier) = harness(planner, false);
    let scenario = verifier.run(Scenario::RadioSilence);
    let action = reconcile(watched(ig("100", Some(status(4)))), h.ctx.clone())
        .await
        .expect("a follower's reconcile succeeds");
    assert_eq!(action, Action::await_change());
    assert_eq!(*planned.lock().expect("counter lock"), 0);
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn losing_the_lease_after_the_reservation_stops_before_the_create() {
    let (h, verifier) = harness(fixed_planner(issuing_plan()), true);
    let ig = ig("100", Some(status(4)));
    let scenario = verifier.run(Scenario::LoseLeadershipDuringReservation {
        ig: ig.clone(),
        plan: issuing_plan(),
        leadership: h.leadership.clone(),
    });
    let action = reconcile(watched(ig), h.ctx.clone())
        .await
        .expect("stepping down is not an error");
    assert_eq!(action, Action::await_change());
    assert!(!h.leadership.is_leader());
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn a_failed_create_after_the_reservation_is_reported_and_retried() {
    let plan = Plan {
        create: vec![attempt("n1", 5), attempt("n2", 6)],
        status: status(6),
        events: vec![event(false, "AttemptIssued", "schedRev 5 on n1")],
        ..Plan::default()
    };
    let (h, verifier) = harness(fixed_planner(plan.clone()), true);
    let ig = ig("100", Some(status(4)));
    let scenario = verifier.run(Scenario::CreateFails {
        ig: ig.clone(),
        plan,
        code: StatusCode::INTERNAL_SERVER_ERROR,
    });
    let error = reconcile(watched(ig), h.ctx.clone())
        .await
        .expect_err("a failed create fails the reconcile");
    assert_eq!(error.metric_label(), "create");
    assert!(
        error.to_string().contains("web-n1-5") && error.to_string().contains("burned"),
        "the error names the attempt and the burned revision: {error}"
    );
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_attempts_issued_total{cause=\"install\",mode=\"overlap\"} 1"
    ));
    // A 500 may have stored it: until the cache shows web-n1-5 (and the
    // created web-n2-6), no plan could see that n1 has its attempt.
    let action = reconcile(watched(ig_at("101", status(6))), h.ctx.clone())
        .await
        .expect("waiting for the cache is not an error");
    assert_eq!(action, Action::requeue(CATCH_UP_RETRY));
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_plans_deferred_total{reason=\"own_create_unseen\"} 1"
    ));
    drop(h.ctx);
    finish(scenario).await;
}

fn ig_at(version: &str, status: InstanceGenerationStatus) -> InstanceGeneration {
    ig(version, Some(status))
}

#[tokio::test]
async fn a_refused_create_is_not_waited_for() {
    let plan = Plan {
        create: vec![attempt("n1", 5), attempt("n2", 6)],
        status: status(6),
        ..Plan::default()
    };
    let settled = Plan {
        status: status(6),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![plan.clone(), settled]);
    let (mut h, verifier) = harness(planner, true);
    let scenario = verifier.run(Scenario::CreateFails {
        ig: ig_at("100", status(4)),
        plan,
        code: StatusCode::TOO_MANY_REQUESTS,
    });
    reconcile(watched(ig_at("100", status(4))), h.ctx.clone())
        .await
        .expect_err("a refused create fails the reconcile");
    // A 429 stored nothing: once the cache shows the create that succeeded,
    // the next plan runs and may issue n1 again.
    h.add_attempt(attempt("n2", 6));
    let action = reconcile(watched(ig_at("101", status(6))), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    assert_eq!(calls(&planned), 2, "planned again at once");
    drop(h.ctx);
    finish(scenario).await;
}

/// The duplicate issue 49 saw: a Lease renewal fails during a burst, the
/// replica steps down and leads again seconds later, with its attempt cache
/// still behind its own creates. What it created as leader is still waited
/// for.
#[tokio::test]
async fn a_replica_that_leads_again_waits_for_the_creates_of_its_last_term() {
    let settled = Plan {
        status: status(5),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![issuing_plan(), settled]);
    let (mut h, verifier) = harness(planner, true);
    let scenario = verifier.run(Scenario::Apply {
        ig: ig_at("100", status(4)),
        plan: issuing_plan(),
    });
    reconcile(watched(ig_at("100", status(4))), h.ctx.clone())
        .await
        .expect("the first reconcile issues web-n1-5");

    h.leadership.set(false);
    let action = reconcile(watched(ig_at("101", status(5))), h.ctx.clone())
        .await
        .expect("a follower's reconcile succeeds");
    assert_eq!(action, Action::await_change());
    h.leadership.set(true);
    waits_until_the_cache_shows(&mut h, ig_at("101", status(5)), attempt("n1", 5), &planned).await;
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn a_plan_that_would_reissue_a_revision_is_refused_before_any_write() {
    for plan in [
        // A create at or below the stored schedRev.
        Plan {
            create: vec![attempt("n1", 4)],
            status: status(5),
            ..Plan::default()
        },
        // A create above the reserved schedRev.
        Plan {
            create: vec![attempt("n1", 6)],
            status: status(5),
            ..Plan::default()
        },
        // Two creates with one revision.
        Plan {
            create: vec![attempt("n1", 5), attempt("n2", 5)],
            status: status(5),
            ..Plan::default()
        },
        // A status that lowers schedRev.
        Plan {
            status: status(3),
            ..Plan::default()
        },
    ] {
        let (h, verifier) = harness(fixed_planner(plan), true);
        let scenario = verifier.run(Scenario::RadioSilence);
        let error = reconcile(watched(ig("100", Some(status(4)))), h.ctx.clone())
            .await
            .expect_err("the plan is refused");
        assert_eq!(error.metric_label(), "plan_invariant", "{error}");
        drop(h.ctx);
        finish(scenario).await;
    }
}

#[tokio::test]
async fn an_object_without_a_resource_version_is_never_written_unconditionally() {
    let (h, verifier) = harness(fixed_planner(issuing_plan()), true);
    let mut object = ig("100", Some(status(4)));
    object.metadata.resource_version = None;
    let scenario = verifier.run(Scenario::RadioSilence);
    let error = reconcile(watched(object), h.ctx.clone())
        .await
        .expect_err("refused");
    assert_eq!(error.metric_label(), "incomplete_object");
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn an_object_being_deleted_gets_no_new_attempts() {
    let (h, verifier) = harness(fixed_planner(issuing_plan()), true);
    let mut object = ig("100", Some(status(4)));
    object.metadata.deletion_timestamp = Some(Time(fixed_now()));
    let scenario = verifier.run(Scenario::RadioSilence);
    let action = reconcile(watched(object), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    assert_eq!(action, Action::await_change());
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn an_unreadable_object_gets_a_warning_and_no_plan() {
    let (h, verifier) = harness(fixed_planner(issuing_plan()), true);
    let invalid = DeserializeGuard(Err(InvalidObject {
        error: "spec.build: missing field `sha256`".into(),
        metadata: ObjectMeta {
            name: Some(IG_NAME.into()),
            namespace: Some(NAMESPACE.into()),
            uid: Some(IG_UID.into()),
            resource_version: Some("100".into()),
            ..ObjectMeta::default()
        },
    }));
    let scenario = verifier.run(Scenario::EventsOnly {
        events: vec![event(true, "InvalidObject", "missing field `sha256`")],
    });
    let action = reconcile(Arc::new(invalid), h.ctx.clone())
        .await
        .expect("an unreadable object is not a reconcile error");
    assert_eq!(action, Action::await_change());
    drop(h.ctx);
    finish(scenario).await;
}

#[tokio::test]
async fn the_planner_sees_the_objects_own_attempts_and_every_node() {
    let seen = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let record = seen.clone();
    let current = status(4);
    let unchanged = Plan {
        status: current.clone(),
        ..Plan::default()
    };
    let planner = Arc::new(
        move |_: &_,
              attempts: &[genswap_crds::SwapAttempt],
              nodes: &[k8s_openapi::api::core::v1::Node],
              now,
              _| {
            assert_eq!(now, fixed_now(), "the injected clock is used");
            let mut seen = record.lock().expect("record lock");
            seen.0 = attempts
                .iter()
                .map(|a| a.metadata.name.clone().unwrap_or_default())
                .collect();
            seen.1 = nodes
                .iter()
                .map(|n| n.metadata.name.clone().unwrap_or_default())
                .collect();
            unchanged.clone()
        },
    );
    let (mut h, verifier) = harness(planner, true);
    h.add_attempt(attempt("n2", 3));
    h.add_attempt(attempt("n1", 4));
    // The same name, owned by an earlier object of that name.
    let mut orphan = attempt("n1", 2);
    orphan.metadata.name = Some("web-n1-2-old".into());
    orphan
        .metadata
        .owner_references
        .as_mut()
        .expect("fixture has owners")[0]
        .uid = "an-older-uid".into();
    h.add_attempt(orphan);
    // Another namespace.
    let mut elsewhere = attempt("n1", 1);
    elsewhere.metadata.namespace = Some("other".into());
    elsewhere.metadata.name = Some("web-n1-1-elsewhere".into());
    h.add_attempt(elsewhere);
    h.add_node(node("n2", &[("pool", "b")]));
    h.add_node(node("n1", &[("pool", "a")]));

    let scenario = verifier.run(Scenario::RadioSilence);
    reconcile(watched(ig("100", Some(current))), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    let seen = seen.lock().expect("record lock").clone();
    assert_eq!(
        seen.0,
        vec!["web-n1-4", "web-n2-3"],
        "own attempts, by node"
    );
    assert_eq!(seen.1, vec!["n1", "n2"], "every node, by name");
    drop(h.ctx);
    finish(scenario).await;
}

/// A new term lists the attempts (metadata only, paged) before it plans:
/// one its cache lacks is waited for, as its own creates are; one the cache
/// shows, and one no IG owns, are not.
#[tokio::test]
async fn a_new_term_waits_for_the_attempts_its_cache_lacks() {
    let settled = Plan {
        status: status(6),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![settled]);
    let (mut h, verifier) = harness(planner, true);
    h.add_attempt(attempt("n1", 5));
    let mut orphan = attempt("n3", 7);
    orphan.metadata.owner_references = None;
    let scenario = verifier.run(Scenario::ListAttempts {
        pages: vec![vec![attempt("n1", 5)], vec![attempt("n2", 6), orphan]],
    });
    let api: kube::Api<SwapAttempt> = kube::Api::namespaced(h.ctx.client.clone(), NAMESPACE);
    let unseen = genswap_controller::term::seed(&api, &h.ctx, std::time::Instant::now())
        .await
        .expect("the list");
    assert_eq!(unseen, 1, "only web-n2-6 is missing from the cache");
    drop(api);
    waits_until_the_cache_shows(&mut h, ig_at("100", status(6)), attempt("n2", 6), &planned).await;
    drop(h.ctx);
    finish(scenario).await;
}

/// A leader whose cache has not shown `web-n1-5` for its whole (zero)
/// patience, whose API server lists the IG's attempts in `pages`; its
/// planner settles at schedRev 5.
fn with_a_lapsed_expectation(
    pages: Vec<Vec<SwapAttempt>>,
) -> (Harness, Arc<Mutex<usize>>, tokio::task::JoinHandle<()>) {
    let settled = Plan {
        status: status(5),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![settled]);
    let (h, verifier) =
        harness_with_patience(planner, true, CacheSync::all_marked(), Duration::ZERO);
    let scenario = verifier.run(Scenario::ListAttemptsOfWeb { pages });
    let web = (NAMESPACE.to_string(), IG_NAME.to_string());
    h.ctx
        .expectations
        .created(&web, "web-n1-5", std::time::Instant::now());
    (h, planned, scenario)
}

/// An attempt the cache has not shown for a whole patience is asked about:
/// the API server holds it, so the watch is behind and the IG waits again
/// instead of planning its node a second attempt.
#[tokio::test]
async fn an_unseen_attempt_the_api_server_holds_is_waited_for_past_the_patience() {
    let (mut h, planned, scenario) =
        with_a_lapsed_expectation(vec![vec![attempt("n2", 4)], vec![attempt("n1", 5)]]);
    let action = reconcile(watched(ig_at("101", status(5))), h.ctx.clone())
        .await
        .expect("waiting is not an error");
    assert_eq!(action, Action::requeue(CATCH_UP_RETRY));
    assert_eq!(calls(&planned), 0, "the planner was not consulted");
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_plans_deferred_total{reason=\"cache_behind_server\"} 1"
    ));
    h.add_attempt(attempt("n1", 5));
    let action = reconcile(watched(ig_at("101", status(5))), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    assert_eq!(calls(&planned), 1, "planned once the cache caught up");
    drop(h.ctx);
    finish(scenario).await;
}

/// An unseen attempt the API server does not hold either (a create that
/// was never stored) is given up on, so the IG is planned.
#[tokio::test]
async fn an_unseen_attempt_the_api_server_lacks_is_given_up_on() {
    let (h, planned, scenario) = with_a_lapsed_expectation(vec![vec![attempt("n2", 4)]]);
    let action = reconcile(watched(ig_at("101", status(5))), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    assert_eq!(calls(&planned), 1, "planned without the attempt");
    drop(h.ctx);
    finish(scenario).await;
}

/// Until its term is seeded a new leader plans nothing; a seed of an older
/// term does not count for a newer one.
#[tokio::test]
async fn a_leader_plans_only_once_its_term_is_seeded() {
    let settled = Plan {
        status: status(5),
        ..Plan::default()
    };
    let (planner, planned) = counting_planner(vec![settled]);
    let (h, verifier) = harness(planner, false);
    let scenario = verifier.run(Scenario::RadioSilence);
    h.leadership.require_seeding();
    h.leadership.set(true);
    let first = h.leadership.term_number();
    let action = reconcile(watched(ig_at("100", status(5))), h.ctx.clone())
        .await
        .expect("waiting is not an error");
    assert_eq!(action, Action::requeue(CATCH_UP_RETRY));
    assert!(metric_line(
        &h.metrics,
        "genswap_controller_plans_deferred_total{reason=\"term_not_seeded\"} 1"
    ));

    h.leadership.set(false);
    h.leadership.set(true);
    h.leadership.mark_seeded(first);
    assert!(
        !h.leadership.term_seeded(),
        "the old term's seed is not this one's"
    );
    h.leadership.mark_seeded(h.leadership.term_number());
    let action = reconcile(watched(ig_at("100", status(5))), h.ctx.clone())
        .await
        .expect("reconcile succeeds");
    assert_eq!(action, Action::requeue(RESYNC_PERIOD));
    assert_eq!(calls(&planned), 1);
    drop(h.ctx);
    finish(scenario).await;
}
