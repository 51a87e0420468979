//! Pre-staging in the scheduler (SPEC 5.15, `rollout.prestage`): a new
//! build's first swap waits until every node that serves another build
//! holds it; a node that cannot stage is named, and the deadline stalls.

mod scheduler_support;

use genswap_crds::{Outcome, StageProgress, StagingState, SwapAttemptStatus};
use scheduler_support::*;

/// Three nodes serving b1, then b2 asked for with `rollout.prestage` on.
fn releasing_b2() -> World {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b", "c"]));
    world.roll_out();
    world.edit(|spec| {
        spec.build = scheduler_support::spec("b2").build;
        spec.rollout.prestage = true;
    });
    world
}

/// `node revN` of each stage-only attempt the plan creates.
fn stage_asks(plan: &genswap_core::scheduler::Plan) -> Vec<String> {
    plan.create
        .iter()
        .filter(|a| a.spec.stage_only)
        .map(|a| format!("{} rev{}", a.spec.node_name, a.spec.sched_rev))
        .collect()
}

fn swaps(plan: &genswap_core::scheduler::Plan) -> Vec<String> {
    plan.create
        .iter()
        .filter(|a| !a.spec.stage_only)
        .map(|a| format!("{} rev{}", a.spec.node_name, a.spec.sched_rev))
        .collect()
}

/// The stage-only attempt of `node` toward the desired build, newest.
fn stage_rev(world: &World, node: &str) -> i64 {
    world
        .attempts
        .iter()
        .filter(|a| a.spec.stage_only && a.spec.node_name == node)
        .map(|a| a.spec.sched_rev)
        .max()
        .unwrap_or_else(|| panic!("no stage attempt on {node}"))
}

#[test]
fn the_first_swap_waits_until_every_node_holds_the_build() {
    let mut world = releasing_b2();
    let plan = world.reconcile();
    assert_eq!(stage_asks(&plan), ["a rev4", "b rev5", "c rev6"]);
    assert!(swaps(&plan).is_empty(), "no swap before the nodes hold b2");
    assert!(
        plan.create
            .iter()
            .all(|a| a.spec.build.id == "b2" && !a.spec.canary)
    );
    let status = world.status();
    assert_eq!(condition(&status, "Reconciling"), "True Prestaging");
    let prestage = status
        .rollout
        .as_ref()
        .and_then(|r| r.prestage.clone())
        .expect("status.rollout.prestage");
    assert_eq!((prestage.staged, prestage.needed), (0, 3));
    assert!(event_reasons(&plan).contains(&"Prestaging".to_string()));

    // Two nodes hold it: still no swap, and the third is shown staging
    // with its bytes.
    world.finish_rev(stage_rev(&world, "a"), done());
    world.finish_rev(stage_rev(&world, "b"), done());
    let c = stage_rev(&world, "c");
    let attempt = world
        .attempts
        .iter_mut()
        .find(|a| a.spec.sched_rev == c)
        .expect("c's stage attempt");
    attempt.status = Some(SwapAttemptStatus {
        stage: Some(StageProgress {
            fetched_bytes: 40,
            total_bytes: Some(100),
        }),
        ..SwapAttemptStatus::default()
    });
    let plan = world.reconcile();
    assert!(plan.create.is_empty(), "{:?}", created(&plan));
    let status = world.status();
    let prestage = status.rollout.as_ref().and_then(|r| r.prestage.clone());
    let prestage = prestage.expect("status.rollout.prestage");
    assert_eq!((prestage.staged, prestage.needed), (2, 3));
    assert_eq!(prestage.fetched_bytes, 40);
    assert_eq!(prestage.nodes.len(), 1);
    assert_eq!(prestage.nodes[0].name, "c");
    assert_eq!(prestage.nodes[0].state, StagingState::Staging);
    assert_eq!(
        (
            prestage.nodes[0].fetched_bytes,
            prestage.nodes[0].total_bytes
        ),
        (40, Some(100))
    );
    assert_eq!(status.counts.as_ref().map(|c| c.staged), Some(2));

    // The last one: the canary goes, and the rollout proceeds as ever.
    world
        .attempts
        .iter_mut()
        .find(|a| a.spec.sched_rev == c)
        .expect("c's stage attempt")
        .status = None;
    world.finish_rev(c, done());
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev7 release canary"]);
    let status = world.status();
    assert_eq!(status.counts.as_ref().map(|c| c.staged), Some(3));
    let prestage = status.rollout.as_ref().and_then(|r| r.prestage.clone());
    let prestage = prestage.expect("status.rollout.prestage is kept");
    assert!(prestage.done_at.is_some());
    assert!(prestage.nodes.is_empty());
    let frozen = prestage.clone();
    // a's ask goes with its swap attempt (one inbox write for both).
    assert_eq!(plan.delete, Vec::<String>::new());
    world.roll_out();
    assert_eq!(
        world.status().rollout.and_then(|r| r.prestage),
        Some(frozen),
        "the record stays as it was when every node held the build"
    );
    assert!(
        world.attempts.iter().all(|a| !a.spec.stage_only),
        "every ask is gone once each node has its swap"
    );
    assert_eq!(condition(&world.status(), "Ready"), "True AllNodesReady");
}

#[test]
fn a_node_that_cannot_stage_is_named_and_the_deadline_stalls_the_rollout() {
    let mut world = releasing_b2();
    world.edit(|spec| spec.rollout.prestage_deadline_seconds = 60);
    world.reconcile();
    world.finish_rev(stage_rev(&world, "a"), done());
    world.finish_rev(stage_rev(&world, "c"), done());
    let mut refused = failed("stage: sha256 of /srv/builds/b2 is 00ff…, not the pinned aa00…");
    refused.executed = false;
    world.finish_rev(stage_rev(&world, "b"), refused);
    let plan = world.reconcile();
    assert!(
        plan.create.is_empty(),
        "a failed stage is not retried by itself"
    );
    let status = world.status();
    assert_eq!(condition(&status, "Reconciling"), "True Prestaging");
    let reconciling = message(&status, "Reconciling");
    assert!(reconciling.contains("2/3 nodes hold it"), "{reconciling}");
    assert!(reconciling.contains("b (stage: sha256"), "{reconciling}");
    assert_eq!(condition(&status, "Stalled"), "False RolloutInProgress");
    let listed = &status
        .rollout
        .as_ref()
        .and_then(|r| r.prestage.clone())
        .expect("prestage")
        .nodes;
    assert_eq!(listed[0].state, StagingState::Failed);
    let deadline = plan.requeue_after.expect("a look again at the deadline");
    assert!(deadline.as_secs() <= 61, "{deadline:?}");

    world.advance(61);
    let plan = world.reconcile();
    let status = world.status();
    assert_eq!(
        condition(&status, "Stalled"),
        "True PrestageDeadlineExceeded"
    );
    assert!(message(&status, "Stalled").contains("rollout.prestageDeadlineSeconds 60"));
    assert!(event_reasons(&plan).contains(&"!PrestageDeadlineExceeded".to_string()));
    let again = world.reconcile();
    assert!(
        !event_reasons(&again).contains(&"!PrestageDeadlineExceeded".to_string()),
        "the Event is sent once"
    );

    // spec.retry asks the node once more.
    world.edit(|spec| spec.retry = "again".into());
    let plan = world.reconcile();
    assert_eq!(stage_asks(&plan).len(), 1);
    assert!(stage_asks(&plan)[0].starts_with("b rev"));
}

#[test]
fn an_abandoned_stage_is_asked_again_after_its_backoff() {
    let mut world = releasing_b2();
    world.reconcile();
    world.finish_rev(stage_rev(&world, "a"), done());
    world.finish_rev(stage_rev(&world, "c"), done());
    let first = stage_rev(&world, "b");
    let mut unreachable = abandoned(false);
    unreachable.reason = "stage: registry 127.0.0.1:5000 could not be connected to".into();
    world.finish_rev(first, unreachable);
    let plan = world.reconcile();
    assert!(plan.create.is_empty(), "the backoff runs first");
    let listed = world
        .status()
        .rollout
        .and_then(|r| r.prestage)
        .expect("prestage")
        .nodes;
    assert_eq!(listed[0].state, StagingState::Abandoned);
    assert!(
        listed[0]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("could not be connected")
    );
    world.advance(6);
    let plan = world.reconcile();
    assert_eq!(stage_asks(&plan).len(), 1);
    let second = stage_rev(&world, "b");
    assert!(second > first);
    world.finish_rev(second, done());
    let plan = world.reconcile();
    assert_eq!(
        created(&plan).len(),
        1,
        "the canary goes: {:?}",
        created(&plan)
    );
    assert!(
        world
            .attempts
            .iter()
            .filter(|a| a.spec.stage_only && a.spec.node_name == "b")
            .all(
                |a| a.status.as_ref().and_then(|s| s.outcome) == Some(Outcome::Done)
                    || a.spec.sched_rev == first
            ),
        "the abandoned one is kept for the backoff count until b's swap"
    );
}

#[test]
fn without_prestage_or_on_an_install_the_canary_goes_at_once() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b"]));
    world.edit(|spec| spec.rollout.prestage = true);
    let plan = world.reconcile();
    assert_eq!(
        created(&plan),
        ["a rev1 install canary"],
        "nothing serves: an install"
    );
    world.roll_out();

    world.edit(|spec| {
        spec.build = scheduler_support::spec("b2").build;
        spec.rollout.prestage = false;
    });
    let plan = world.reconcile();
    assert_eq!(swaps(&plan).len(), 1);
    assert!(stage_asks(&plan).is_empty());
}

#[test]
fn a_config_change_on_the_same_build_is_not_prestaged() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b"]));
    world.roll_out();
    world.edit(|spec| {
        spec.rollout.prestage = true;
        spec.config_rev = "2".into();
    });
    let plan = world.reconcile();
    assert!(stage_asks(&plan).is_empty());
    assert_eq!(created(&plan), ["a rev3 config canary"]);
}

#[test]
fn a_newer_build_replaces_the_asks_of_the_one_before() {
    let mut world = releasing_b2();
    world.reconcile();
    world.finish_rev(stage_rev(&world, "a"), done());
    world.edit(|spec| spec.build = scheduler_support::spec("b3").build);
    let plan = world.reconcile();
    assert_eq!(stage_asks(&plan).len(), 3, "b3 is asked of every node");
    assert_eq!(plan.delete.len(), 3, "b2's asks go: {:?}", plan.delete);
    let prestage = world
        .status()
        .rollout
        .and_then(|r| r.prestage)
        .expect("prestage");
    assert_eq!((prestage.build.as_str(), prestage.staged), ("b3", 0));
}

#[test]
fn a_new_digest_under_the_same_build_id_is_staged_again() {
    let mut world = releasing_b2();
    world.reconcile();
    for node in ["a", "b", "c"] {
        world.finish_rev(stage_rev(&world, node), done());
    }
    let plan = world.reconcile();
    assert_eq!(swaps(&plan).len(), 1, "the canary goes once all hold b2");
    let first = world
        .status()
        .rollout
        .and_then(|r| r.prestage)
        .expect("prestage");
    assert!(first.done_at.is_some(), "{first:?}");

    // b2 is rebuilt under the same id: no node holds those bytes.
    world.edit(|spec| spec.build.sha256 = "c".repeat(64));
    let plan = world.reconcile();
    assert_eq!(stage_asks(&plan).len(), 3, "{:?}", created(&plan));
    assert!(swaps(&plan).is_empty(), "{:?}", created(&plan));
    let record = world
        .status()
        .rollout
        .and_then(|r| r.prestage)
        .expect("prestage");
    assert_eq!(record.sha256.as_deref(), Some("c".repeat(64).as_str()));
    assert_eq!((record.staged, record.needed), (0, 3));
    assert_eq!(record.done_at, None);
}
