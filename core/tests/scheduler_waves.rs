//! Progressive delivery in the scheduler (SPEC 4.2): percentages, waves by a
//! node label, the bake between waves, and the progress deadline.

mod scheduler_support;

use genswap_crds::{RolloutStatus, WavesSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use scheduler_support::*;

fn percent(text: &str) -> IntOrString {
    IntOrString::String(text.into())
}

/// `count` nodes named `n00`, `n01`, … (sorted = rollout order), the
/// zone label cycling through `zones`.
fn zoned(count: usize, zones: &[&str]) -> Vec<Node> {
    (0..count)
        .map(|i| {
            node(
                &format!("n{i:02}"),
                &[("topology.kubernetes.io/zone", zones[i % zones.len()])],
            )
        })
        .collect()
}

fn by_zone(order: &[&str]) -> Option<WavesSpec> {
    Some(WavesSpec {
        by_label: "topology.kubernetes.io/zone".into(),
        order: order.iter().map(|v| v.to_string()).collect(),
    })
}

/// The nodes each created attempt is for.
fn created_nodes(plan: &genswap_core::scheduler::Plan) -> Vec<String> {
    plan.create
        .iter()
        .map(|a| a.spec.node_name.clone())
        .collect()
}

fn rollout(plan: &genswap_core::scheduler::Plan) -> RolloutStatus {
    plan.status.rollout.clone().unwrap_or_default()
}

#[test]
fn percentages_round_up_and_are_at_least_one() {
    for (canaries, parallel, nodes, first, then) in [
        // 10% of 25 nodes is 2.5: three canaries, then three at a time.
        ("10%", "10%", 25, 3, 3),
        // 1% of 25 is a quarter of a node: one.
        ("1%", "1%", 25, 1, 1),
        ("0%", "50%", 4, 0, 2),
        ("100%", "1%", 4, 4, 0),
    ] {
        let mut s = spec("b1");
        s.rollout.canary_nodes = percent(canaries);
        s.rollout.max_parallel = percent(parallel);
        let names: Vec<String> = (0..nodes).map(|i| format!("n{i:02}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let mut world = World::new(ig(s), scheduler_support::nodes(&names));
        let plan = world.reconcile();
        let case = format!("canaryNodes {canaries}, maxParallel {parallel}, {nodes} nodes");
        if first > 0 {
            assert_eq!(plan.create.len(), first, "{case}: the canaries");
            assert!(plan.create.iter().all(|a| a.spec.canary), "{case}");
            world.finish_all_done();
            let plan = world.reconcile();
            assert_eq!(plan.create.len(), then, "{case}: then at a time");
        } else {
            assert_eq!(plan.create.len(), then, "{case}: no canaries");
            assert!(plan.create.iter().all(|a| !a.spec.canary), "{case}");
        }
    }
}

#[test]
fn waves_go_one_zone_at_a_time_in_the_order_given_after_the_canary() {
    let mut s = spec("b1");
    s.rollout.max_parallel = IntOrString::Int(10);
    s.rollout.waves = by_zone(&["zone-c"]);
    let mut world = World::new(ig(s), zoned(9, &["zone-a", "zone-b", "zone-c"]));

    let plan = world.reconcile();
    assert_eq!(created_nodes(&plan), ["n00"], "the canary first");
    let position = rollout(&plan);
    assert_eq!(position.wave.as_deref(), Some("canary"));
    assert_eq!((position.wave_index, position.waves), (Some(0), Some(3)));
    world.finish_all_done();

    // zone-c as listed, then the others by name; maxParallel (10) would
    // take every node, the wave takes only its own.
    let plan = world.reconcile();
    assert_eq!(created_nodes(&plan), ["n02", "n05", "n08"]);
    assert_eq!(rollout(&plan).wave.as_deref(), Some("zone-c"));
    assert!(
        message(&plan.status, "Reconciling").contains("wave zone-c (1 of 3)"),
        "{}",
        message(&plan.status, "Reconciling")
    );
    world.finish("n02", done());
    world.finish("n05", done());
    assert!(
        world.reconcile().create.is_empty(),
        "zone-a waits for the last node of zone-c"
    );
    world.finish("n08", done());
    let plan = world.reconcile();
    // n00, the canary, is in zone-a but already done.
    assert_eq!(created_nodes(&plan), ["n03", "n06"]);
    assert_eq!(rollout(&plan).wave.as_deref(), Some("zone-a"));
    world.finish_all_done();
    assert_eq!(created_nodes(&world.reconcile()), ["n01", "n04", "n07"]);
    world.finish_all_done();
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(plan.status.ready.as_deref(), Some("9/9"));
    assert_eq!(rollout(&plan).wave, None, "every wave is done");
}

#[test]
fn max_parallel_applies_within_a_wave_and_unlabelled_nodes_go_last() {
    let mut s = spec("b1");
    s.rollout.canary_nodes = IntOrString::Int(0);
    s.rollout.max_parallel = IntOrString::Int(2);
    s.rollout.waves = by_zone(&[]);
    let mut nodes = zoned(6, &["z1", "z2"]);
    nodes.push(node("n99", &[]));
    let mut world = World::new(ig(s), nodes);
    assert_eq!(created_nodes(&world.reconcile()), ["n00", "n02"]);
    world.finish_all_done();
    assert_eq!(created_nodes(&world.reconcile()), ["n04"]);
    world.finish_all_done();
    assert_eq!(created_nodes(&world.reconcile()), ["n01", "n03"]);
    world.finish_all_done();
    assert_eq!(created_nodes(&world.reconcile()), ["n05"]);
    world.finish_all_done();
    let plan = world.reconcile();
    assert_eq!(created_nodes(&plan), ["n99"]);
    assert_eq!(rollout(&plan).wave.as_deref(), Some("(unlabelled)"));
}

#[test]
fn a_finished_wave_bakes_before_the_next_starts() {
    let mut s = spec("b1");
    s.rollout.max_parallel = IntOrString::Int(10);
    s.rollout.bake_seconds = 300;
    s.rollout.waves = by_zone(&[]);
    let mut world = World::new(ig(s), zoned(4, &["z1", "z2"]));
    world.reconcile();
    world.finish_all_done();

    let plan = world.reconcile();
    assert!(plan.create.is_empty(), "the canary bakes first");
    let position = rollout(&plan);
    assert_eq!(position.wave.as_deref(), Some("canary"));
    assert_eq!(
        position.baking_until,
        Some(time(T0 + 301)),
        "from the end of the second the canary took over in"
    );
    assert_eq!(
        plan.requeue_after,
        Some(std::time::Duration::from_secs(301)),
        "the controller looks again when the bake ends"
    );
    assert!(message(&plan.status, "Reconciling").contains("bakes until"));

    world.advance(300);
    assert!(world.reconcile().create.is_empty());
    world.advance(1);
    let plan = world.reconcile();
    assert_eq!(
        created_nodes(&plan),
        ["n02"],
        "z1 (n00, the canary, is done)"
    );
    world.finish_all_done();
    let plan = world.reconcile();
    assert!(plan.create.is_empty(), "z1 bakes");
    world.advance(301);
    assert_eq!(created_nodes(&world.reconcile()), ["n01", "n03"]);
    world.finish_all_done();
    let plan = world.reconcile();
    assert_eq!(
        rollout(&plan).baking_until,
        None,
        "the last wave has nothing after it to wait for"
    );
    assert_eq!(plan.status.ready.as_deref(), Some("4/4"));
}

#[test]
fn a_rollout_that_does_not_move_is_stalled_at_its_deadline_naming_the_nodes() {
    let mut s = spec("b1");
    s.rollout.progress_deadline_seconds = 600;
    let mut world = World::new(ig(s), nodes(&["a", "b"]));
    let plan = world.reconcile();
    assert_eq!(rollout(&plan).last_progress_time, Some(time(T0)));
    assert!(
        plan.requeue_after
            .is_some_and(|after| after > std::time::Duration::from_secs(600)),
        "the controller looks again past the deadline: {:?}",
        plan.requeue_after
    );

    world.advance(600);
    let plan = world.reconcile();
    assert!(
        condition(&plan.status, "Stalled").starts_with("False "),
        "not past the deadline yet"
    );

    world.advance(1);
    let plan = world.reconcile();
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False ProgressDeadlineExceeded | Reconciling=True RolloutInProgress | Stalled=True ProgressDeadlineExceeded"
    );
    let stalled = message(&plan.status, "Stalled");
    assert!(
        stalled.contains(&format!("since {}", at(T0)))
            && stalled.contains("attempts in flight on: a"),
        "{stalled}"
    );
    assert_eq!(event_reasons(&plan), ["!ProgressDeadlineExceeded"]);
    let again = world.reconcile();
    assert!(event_reasons(&again).is_empty(), "the Event goes out once");
    world.advance(60);
    assert_eq!(
        world.reconcile().status,
        again.status,
        "a stalled rollout's status stays as it is: nothing to write"
    );

    // The canary's outcome is progress: the clock starts again.
    world.finish("a", done());
    let plan = world.reconcile();
    assert!(condition(&plan.status, "Stalled").starts_with("False "));
    assert_eq!(rollout(&plan).last_progress_time, Some(time(T0 + 661)));
}

#[test]
fn the_deadline_does_not_run_while_paused_baking_or_at_rest() {
    let mut s = spec("b1");
    s.rollout.progress_deadline_seconds = 60;
    s.rollout.bake_seconds = 3600;
    let mut world = World::new(ig(s), nodes(&["a", "b"]));
    world.reconcile();
    world.finish_all_done();
    world.reconcile();
    world.advance(3000);
    let plan = world.reconcile();
    assert!(rollout(&plan).baking_until.is_some());
    assert!(
        condition(&plan.status, "Stalled").starts_with("False "),
        "baking"
    );

    world.edit(|s| s.rollout.paused = true);
    world.advance(700);
    let plan = world.reconcile();
    assert!(
        condition(&plan.status, "Stalled").starts_with("False "),
        "paused"
    );

    world.edit(|s| s.rollout.paused = false);
    world.reconcile();
    world.finish_all_done();
    let plan = world.reconcile();
    assert_eq!(plan.status.ready.as_deref(), Some("2/2"));
    let last = rollout(&plan).last_progress_time;
    world.advance(7200);
    let plan = world.reconcile();
    assert!(
        condition(&plan.status, "Stalled").starts_with("False "),
        "at rest"
    );
    assert_eq!(
        rollout(&plan).last_progress_time,
        last,
        "at rest, unchanged"
    );
    assert_eq!(
        world.reconcile().status,
        plan.status,
        "a plan at rest writes nothing new"
    );
}
