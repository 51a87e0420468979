//! `status.history`, a rollback through it, and `rollout.paused` (SPEC 4.5),
//! scenario by scenario against the scheduler.

mod scheduler_support;

use genswap_core::scheduler::HISTORY_KEPT;
use genswap_crds::{Cause, InstanceGenerationStatus};
use scheduler_support::*;

fn three_nodes(build: &str) -> World {
    World::new(ig(spec(build)), nodes(&["a", "b", "c"]))
}

/// The builds in `status.history`, newest first.
fn history(status: &InstanceGenerationStatus) -> Vec<String> {
    status.history.iter().map(|h| h.build.clone()).collect()
}

/// Releases `build` (a new spec.build, everything else kept).
fn release(world: &mut World, build: &str) {
    world.edit(|s| s.build = spec(build).build);
}

#[test]
fn a_build_enters_the_history_once_every_node_serves_it() {
    let mut world = three_nodes("b1");
    world.reconcile();
    world.finish("a", done());
    let plan = world.reconcile();
    assert_eq!(
        history(&plan.status),
        Vec::<String>::new(),
        "1/3 is not yet"
    );
    world.roll_out();
    let status = world.status();
    assert_eq!(history(&status), ["b1"]);
    let entry = &status.history[0];
    assert_eq!(entry.sha256, sha("b1"));
    assert_eq!(entry.artifact.path.as_deref(), Some("/srv/builds/b1"));

    // Planning again with nothing new changes nothing, time included.
    world.advance(60);
    let again = world.reconcile();
    assert_eq!(again.status.history, status.history);
}

#[test]
fn a_build_that_halts_at_its_canary_never_enters_the_history() {
    let mut world = three_nodes("b1");
    world.roll_out();
    release(&mut world, "b2");
    world.reconcile();
    world.finish("a", failed("the new build crashed"));
    let plan = world.reconcile();
    assert_eq!(history(&plan.status), ["b1"]);
}

#[test]
fn the_history_is_newest_first_without_repeats_and_bounded() {
    let mut world = three_nodes("b0");
    world.roll_out();
    for n in 1..=HISTORY_KEPT + 1 {
        release(&mut world, &format!("b{n}"));
        world.roll_out();
    }
    let builds = history(&world.status());
    assert_eq!(builds.len(), HISTORY_KEPT);
    assert_eq!(builds[0], format!("b{}", HISTORY_KEPT + 1));
    assert_eq!(builds[HISTORY_KEPT - 1], "b2");

    // Going back to one that is there moves it to the front.
    release(&mut world, "b3");
    world.roll_out();
    let builds = history(&world.status());
    assert_eq!(builds.len(), HISTORY_KEPT);
    assert_eq!(builds[0], "b3");
    assert_eq!(builds.iter().filter(|b| *b == "b3").count(), 1);
}

#[test]
fn an_undo_is_a_release_of_the_history_entry() {
    let mut world = three_nodes("b1");
    world.roll_out();
    release(&mut world, "b2");
    world.roll_out();
    let status = world.status();
    assert_eq!(history(&status), ["b2", "b1"]);

    // What `kubectl genswap undo` writes: the entry's build, as it was.
    let previous = status.history[1].clone();
    world.edit(|s| {
        s.build.id = previous.build.clone();
        s.build.sha256 = previous.sha256.clone();
        s.build.artifact = (&previous.artifact).into();
    });
    let plan = world.reconcile();
    assert_eq!(causes(&plan), [Cause::Release]);
    let attempt = &plan.create[0].spec;
    assert_eq!(attempt.build.id, "b1");
    assert_eq!(
        attempt.build.artifact.path.as_deref(),
        Some("/srv/builds/b1")
    );
    world.roll_out();
    assert_eq!(history(&world.status()), ["b1", "b2"]);
}

#[test]
fn a_paused_rollout_issues_nothing_and_lets_in_flight_attempts_finish() {
    // (what is paused, what the plan does, Reconciling afterwards)
    let mut world = three_nodes("b1");
    world.roll_out();
    release(&mut world, "b2");
    world.reconcile();
    assert_eq!(world.in_flight().len(), 1, "the canary runs");

    world.edit(|s| s.rollout.paused = true);
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(condition(&plan.status, "Reconciling"), "True Paused");

    // The canary in flight finishes and is recorded; nobody follows it.
    world.finish("a", done());
    let plan = world.reconcile();
    assert_eq!(event_reasons(&plan), ["SwapDone"]);
    assert!(plan.create.is_empty());
    assert_eq!(plan.status.ready.as_deref(), Some("1/3"));
    assert_eq!(condition(&plan.status, "Reconciling"), "True Paused");
    assert_eq!(
        message(&plan.status, "Reconciling"),
        "spec.rollout.paused: no new attempts toward build b2; 0 attempt(s) in flight finish, 2 node(s) wait for the rollout to resume"
    );

    // A new release while paused issues nothing either.
    release(&mut world, "b3");
    assert!(world.reconcile().create.is_empty());

    world.edit(|s| s.rollout.paused = false);
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev5 release canary"]);
    assert_eq!(
        condition(&plan.status, "Reconciling"),
        "True RolloutInProgress"
    );
}

#[test]
fn a_paused_instance_that_serves_everywhere_is_ready_and_not_reconciling() {
    let mut world = three_nodes("b1");
    world.roll_out();
    world.edit(|s| s.rollout.paused = true);
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(
        kstatus(&plan.status),
        "Ready=True AllNodesReady | Reconciling=False AllNodesReady | Stalled=False AllNodesReady"
    );
}

#[test]
fn what_a_pause_withholds_table() {
    // (situation, set up the world, paused, attempts created, Reconciling)
    type Setup = fn() -> World;
    let first_rollout: Setup = || three_nodes("b1");
    let release_over_b1: Setup = || {
        let mut world = three_nodes("b1");
        world.roll_out();
        release(&mut world, "b2");
        world
    };
    let settled: Setup = || {
        let mut world = three_nodes("b1");
        world.roll_out();
        world
    };
    let rows: [(&str, Setup, bool, &[&str], &str); 6] = [
        (
            "a first rollout",
            first_rollout,
            false,
            &["a rev1 install canary"],
            "True RolloutInProgress",
        ),
        (
            "a first rollout, paused",
            first_rollout,
            true,
            &[],
            "True Paused",
        ),
        (
            "a release",
            release_over_b1,
            false,
            &["a rev4 release canary"],
            "True RolloutInProgress",
        ),
        (
            "a release, paused",
            release_over_b1,
            true,
            &[],
            "True Paused",
        ),
        ("nothing to do", settled, false, &[], "False AllNodesReady"),
        (
            "nothing to do, paused",
            settled,
            true,
            &[],
            "False AllNodesReady",
        ),
    ];
    for (situation, setup, paused, expected, reconciling) in rows {
        let mut world = setup();
        world.edit(|s| s.rollout.paused = paused);
        let plan = world.reconcile();
        assert_eq!(created(&plan), expected, "{situation}: created");
        assert_eq!(
            condition(&plan.status, "Reconciling"),
            reconciling,
            "{situation}: Reconciling"
        );
    }
}
