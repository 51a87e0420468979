//! A refusal that keeps coming back (SPEC 7, issue 14): attempts abandoned
//! for one reason three times in a row are still retried with backoff,
//! but the InstanceGeneration says `Stalled=True` with that reason until
//! the desired state changes or an attempt succeeds.

mod scheduler_support;

use scheduler_support::*;

fn refused(reason: &str) -> Finish {
    Finish {
        reason: reason.into(),
        ..abandoned(false)
    }
}

const DIRECTORY: &str = "stage: the artifact path /opt/web/b1 is a directory, not a file";

/// One node; `refusals` attempts of b1 refused for `DIRECTORY`, each
/// re-issued after its backoff, and planned again while the re-issue is in
/// flight (as the adapters do: that plan must keep the refused ones).
fn refused_times(refusals: usize) -> World {
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    for _ in 0..refusals {
        world.reconcile();
        world.reconcile();
        world.finish("a", refused(DIRECTORY));
        world.advance(600);
    }
    world
}

#[test]
fn the_same_refusal_three_times_in_a_row_is_stalled_and_still_retried() {
    let mut world = refused_times(2);
    world.reconcile();
    assert_eq!(
        condition(&world.status(), "Stalled"),
        "False RolloutInProgress"
    );
    world.finish("a", refused(DIRECTORY));
    let plan = world.reconcile();
    let status = world.status();
    assert_eq!(condition(&status, "Stalled"), "True RepeatedRefusal");
    assert_eq!(condition(&status, "Ready"), "False RepeatedRefusal");
    let message = message(&status, "Stalled");
    assert!(message.contains(DIRECTORY), "{message}");
    assert!(message.contains("the last 3 attempts"), "{message}");
    // Retried after the backoff all the same: the file may appear.
    assert!(plan.create.is_empty(), "the backoff holds it back for now");
    world.advance(600);
    assert_eq!(
        created(&world.reconcile()).len(),
        1,
        "re-issued after the backoff"
    );
}

#[test]
fn different_reasons_are_not_a_repeated_refusal() {
    let mut world = refused_times(2);
    world.reconcile();
    world.finish("a", refused("admit: the agent is shutting down"));
    world.reconcile();
    assert_eq!(
        condition(&world.status(), "Stalled"),
        "False RolloutInProgress"
    );
}

#[test]
fn a_success_or_a_new_desired_state_clears_it() {
    let mut world = refused_times(3);
    world.reconcile();
    assert_eq!(
        condition(&world.status(), "Stalled"),
        "True RepeatedRefusal"
    );
    world.finish("a", done());
    world.reconcile();
    assert_eq!(condition(&world.status(), "Stalled"), "False AllNodesReady");

    let mut world = refused_times(3);
    world.reconcile();
    world.edit(|spec| spec.build = scheduler_support::spec("b2").build);
    world.reconcile();
    assert_eq!(
        condition(&world.status(), "Stalled"),
        "False RolloutInProgress"
    );
}
