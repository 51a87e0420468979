//! The scheduler, scenario by scenario: given these objects, the plan is this.
//!
//! Every scenario runs against [`World`], which stores what the API server
//! would and applies each plan the way the adapter does. Nodes are named so
//! that their sorted order is the rollout order.

mod scheduler_support;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::time::Duration;

use genswap_core::scheduler::{LABEL_INSTANCE, LABEL_NODE, plan};
use genswap_crds::{Cause, InstanceGenerationStatus, Mode, NodeRecord, Outcome, SocketLayout};
use scheduler_support::*;

/// Three nodes, defaults: canaryNodes 1, maxParallel 1, haltOnFailure.
fn three_nodes(build: &str) -> World {
    World::new(ig(spec(build)), nodes(&["a", "b", "c"]))
}

/// Three nodes that all serve `b0`, then the spec moves to `b1`.
fn serving_b0_then(build: &str) -> World {
    let mut world = three_nodes("b0");
    world.roll_out();
    world.edit(|s| *s = spec_like(&s.clone(), build));
    world
}

/// `spec` with another build, keeping every other field.
fn spec_like(
    current: &genswap_crds::InstanceGenerationSpec,
    build: &str,
) -> genswap_crds::InstanceGenerationSpec {
    let mut next = current.clone();
    next.build = spec(build).build;
    next
}

// ---------------------------------------------------------------------------
// First rollout, canaries, maxParallel
// ---------------------------------------------------------------------------

#[test]
fn a_first_rollout_goes_canary_first_then_one_node_at_a_time() {
    let mut world = three_nodes("b1");

    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev1 install canary"]);
    assert_eq!(plan.status.sched_rev, 1);
    assert_eq!(plan.status.ready.as_deref(), Some("0/3"));
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False RolloutInProgress | Reconciling=True RolloutInProgress | Stalled=False RolloutInProgress"
    );

    let plan = world.reconcile();
    assert_eq!(
        created(&plan),
        Vec::<String>::new(),
        "b waits for the canary"
    );

    world.finish("a", done());
    let plan = world.reconcile();
    assert_eq!(event_reasons(&plan), ["SwapDone", "AttemptIssued"]);
    assert_eq!(created(&plan), ["b rev2 install"]);
    assert_eq!(plan.status.ready.as_deref(), Some("1/3"));

    world.finish("b", done());
    assert_eq!(created(&world.reconcile()), ["c rev3 install"]);

    world.finish("c", done());
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(plan.status.ready.as_deref(), Some("3/3"));
    assert_eq!(plan.status.good_build.as_deref(), Some("b1"));
    assert_eq!(
        kstatus(&plan.status),
        "Ready=True AllNodesReady | Reconciling=False AllNodesReady | Stalled=False AllNodesReady"
    );
    assert_eq!(message(&plan.status, "Ready"), "all 3 nodes serve build b1");
    let a = entry(&plan.status, "a");
    assert_eq!(a.build.as_deref(), Some("b1"));
    assert_eq!(a.generation, Some(1));
    assert_eq!(a.since, Some(time(T0)), "since = the attempt's finishedAt");
    assert_eq!(
        a.last_attempt.as_ref().map(|l| (l.sched_rev, l.outcome)),
        Some((1, Outcome::Done))
    );
}

#[test]
fn cohorts_follow_canary_nodes_and_max_parallel() {
    struct Case {
        name: &'static str,
        canary_nodes: i32,
        max_parallel: i32,
        /// What each reconcile creates; every in-flight attempt is then done.
        waves: &'static [&'static [&'static str]],
    }
    let cases = [
        Case {
            name: "no canary cohort: maxParallel from the start",
            canary_nodes: 0,
            max_parallel: 2,
            waves: &[
                &["a rev1 install", "b rev2 install"],
                &["c rev3 install", "d rev4 install"],
            ],
        },
        Case {
            name: "two canaries go together, then one at a time",
            canary_nodes: 2,
            max_parallel: 1,
            waves: &[
                &["a rev1 install canary", "b rev2 install canary"],
                &["c rev3 install"],
                &["d rev4 install"],
            ],
        },
        Case {
            name: "one canary, then two at a time",
            canary_nodes: 1,
            max_parallel: 2,
            waves: &[
                &["a rev1 install canary"],
                &["b rev2 install", "c rev3 install"],
                &["d rev4 install"],
            ],
        },
        Case {
            name: "more canaries than nodes: every node is a canary",
            canary_nodes: 9,
            max_parallel: 1,
            waves: &[&[
                "a rev1 install canary",
                "b rev2 install canary",
                "c rev3 install canary",
                "d rev4 install canary",
            ]],
        },
    ];
    for case in cases {
        let mut s = spec("b1");
        s.rollout.canary_nodes = IntOrString::Int(case.canary_nodes);
        s.rollout.max_parallel = IntOrString::Int(case.max_parallel);
        let mut world = World::new(ig(s), nodes(&["a", "b", "c", "d"]));
        for (wave, expected) in case.waves.iter().enumerate() {
            let plan = world.reconcile();
            assert_eq!(created(&plan), *expected, "{}: wave {wave}", case.name);
            world.finish_all_done();
        }
        let plan = world.reconcile();
        assert!(
            plan.create.is_empty(),
            "{}: nothing after the last wave",
            case.name
        );
        assert_eq!(plan.status.ready.as_deref(), Some("4/4"), "{}", case.name);
    }
}

#[test]
fn a_canary_that_is_done_while_another_is_not_holds_the_rest_back() {
    let mut s = spec("b1");
    s.rollout.canary_nodes = IntOrString::Int(2);
    let mut world = World::new(ig(s), nodes(&["a", "b", "c"]));
    world.reconcile();
    world.finish("a", done());
    assert!(world.reconcile().create.is_empty(), "b is still in flight");
    world.finish("b", done());
    assert_eq!(created(&world.reconcile()), ["c rev3 install"]);
}

// ---------------------------------------------------------------------------
// Desired state, drift and causes
// ---------------------------------------------------------------------------

#[test]
fn the_cause_follows_what_changed_on_the_node() {
    struct Case {
        name: &'static str,
        /// The node's status entry before the plan; `None`: never ran.
        serves: Option<genswap_crds::NodeGeneration>,
        spec: genswap_crds::InstanceGenerationSpec,
        /// `None`: the node serves the desired state, no attempt.
        cause: Option<Cause>,
    }
    let with = |build: &str, change: fn(&mut genswap_crds::InstanceGenerationSpec)| {
        let mut s = spec(build);
        change(&mut s);
        s
    };
    let cases = [
        Case {
            name: "no generation yet",
            serves: None,
            spec: spec("b1"),
            cause: Some(Cause::Install),
        },
        Case {
            name: "a new build",
            serves: Some(serving("a", "b0", 3)),
            spec: spec("b1"),
            cause: Some(Cause::Release),
        },
        Case {
            name: "only configRev changed",
            serves: Some(serving("a", "b1", 3)),
            spec: with("b1", |s| s.config_rev = "c2".into()),
            cause: Some(Cause::Config),
        },
        Case {
            name: "only restartID changed",
            serves: Some(serving("a", "b1", 3)),
            spec: with("b1", |s| s.restart_id = "r2".into()),
            cause: Some(Cause::Restart),
        },
        Case {
            name: "configRev and restartID changed: config says more",
            serves: Some(serving("a", "b1", 3)),
            spec: with("b1", |s| {
                s.config_rev = "c2".into();
                s.restart_id = "r2".into();
            }),
            cause: Some(Cause::Config),
        },
        Case {
            name: "same build id, another digest: a new build",
            serves: Some(serving("a", "b1", 3)),
            spec: with("b1", |s| s.build.sha256 = "f".repeat(64)),
            cause: Some(Cause::Release),
        },
        Case {
            name: "the spec's cause for a new build",
            serves: Some(serving("a", "b0", 3)),
            spec: with("b1", |s| s.cause = Cause::Restart),
            cause: Some(Cause::Restart),
        },
        Case {
            name: "a spec asking for `retry` gets release: retry is the armed allowance's",
            serves: Some(serving("a", "b0", 3)),
            spec: with("b1", |s| s.cause = Cause::Retry),
            cause: Some(Cause::Release),
        },
        Case {
            name: "the node serves the desired state",
            serves: Some(serving("a", "b1", 3)),
            spec: spec("b1"),
            cause: None,
        },
        Case {
            name: "only the mode changed: how to move, not what runs",
            serves: Some(serving("a", "b1", 3)),
            spec: with("b1", |s| s.mode = Mode::Hold),
            cause: None,
        },
    ];
    for case in cases {
        let mut ig = ig(case.spec);
        ig.status = Some(InstanceGenerationStatus {
            nodes: case.serves.into_iter().collect(),
            ..InstanceGenerationStatus::default()
        });
        let plan = plan(&ig, NO_ATTEMPTS, &nodes(&["a"]), at(T0));
        assert_eq!(
            causes(&plan),
            case.cause.into_iter().collect::<Vec<_>>(),
            "{}",
            case.name
        );
    }
}

#[test]
fn the_status_carries_the_desired_tuple_and_the_observed_generation() {
    let mut world = serving_b0_then("b1");
    world.edit(|s| s.config_rev = "c7".into());
    let plan = world.reconcile();
    let desired = plan.status.desired.as_ref().expect("desired is written");
    assert_eq!(desired, &world.ig.spec.desired());
    assert_eq!(desired.config_rev, "c7");
    assert_eq!(plan.status.observed_generation, Some(3));
    for condition in &plan.status.conditions {
        assert_eq!(
            condition.observed_generation,
            Some(3),
            "{}",
            condition.type_
        );
    }
}

// ---------------------------------------------------------------------------
// Node selection: added, removed, relabelled
// ---------------------------------------------------------------------------

#[test]
fn the_selector_picks_nodes_whose_labels_include_it() {
    let cluster = vec![
        node("a", &[("pool", "edge"), ("zone", "1")]),
        node("b", &[("pool", "edge"), ("zone", "2")]),
        node("c", &[("pool", "core")]),
        node("d", &[]),
    ];
    type Labels<'a> = &'a [(&'a str, &'a str)];
    let cases: [(Labels<'_>, &[&str]); 4] = [
        (&[], &["a", "b", "c", "d"]),
        (&[("pool", "edge")], &["a", "b"]),
        (&[("pool", "edge"), ("zone", "2")], &["b"]),
        (&[("pool", "gpu")], &[]),
    ];
    for (selector, expected) in cases {
        let mut s = spec("b1");
        s.node_selector = selector
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let plan = plan(&ig(s), NO_ATTEMPTS, &cluster, at(T0));
        let selected: Vec<&str> = plan.status.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(selected, expected, "selector {selector:?}");
        assert_eq!(
            plan.status.ready,
            Some(format!("0/{}", expected.len())),
            "selector {selector:?}"
        );
    }
}

#[test]
fn no_matching_node_is_not_ready_but_not_stalled_either() {
    let mut s = spec("b1");
    s.node_selector = [("pool".to_string(), "gpu".to_string())].into();
    let plan = plan(&ig(s), NO_ATTEMPTS, &nodes(&["a", "b"]), at(T0));
    assert!(plan.create.is_empty());
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False NoMatchingNodes | Reconciling=False NoMatchingNodes | Stalled=False NoMatchingNodes"
    );
    assert_eq!(
        message(&plan.status, "Ready"),
        "no node has the labels pool=gpu"
    );
    assert_eq!(plan.status.ready.as_deref(), Some("0/0"));
}

#[test]
fn an_added_node_gets_an_install_and_a_new_first_node_is_the_canary() {
    let mut world = three_nodes("b1");
    world.roll_out();
    let rev = world.status().sched_rev;

    world.nodes.push(node("d", &[]));
    let plan = world.reconcile();
    assert_eq!(created(&plan), [format!("d rev{} install", rev + 1)]);
    world.finish_all_done();
    world.reconcile();

    // "0-edge" sorts first: it is the canary now, and "e" waits for it.
    world.nodes.push(node("0-edge", &[]));
    world.nodes.push(node("e", &[]));
    let plan = world.reconcile();
    assert_eq!(
        created(&plan),
        [format!("0-edge rev{} install canary", rev + 2)]
    );
    world.finish_all_done();
    assert_eq!(
        created(&world.reconcile()),
        [format!("e rev{} install", rev + 3)]
    );
}

#[test]
fn a_removed_or_relabelled_node_loses_its_attempts_and_its_entry() {
    let mut s = spec("b1");
    s.node_selector = [("pool".to_string(), "edge".to_string())].into();
    let edge = [("pool", "edge")];
    let mut world = World::new(
        ig(s),
        vec![node("a", &edge), node("b", &edge), node("c", &edge)],
    );
    world.roll_out();
    assert_eq!(world.status().ready.as_deref(), Some("3/3"));

    world
        .nodes
        .retain(|n| n.metadata.name.as_deref() != Some("c"));
    let plan = world.reconcile();
    assert_eq!(plan.delete, ["web-c-3"]);
    let names: Vec<&str> = plan.status.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(plan.status.ready.as_deref(), Some("2/2"));
    assert_eq!(condition(&plan.status, "Ready"), "True AllNodesReady");

    world.nodes[1] = node("b", &[("pool", "core")]);
    let plan = world.reconcile();
    assert_eq!(plan.delete, ["web-b-2"]);
    assert_eq!(plan.status.ready.as_deref(), Some("1/1"));
}

#[test]
fn attempts_of_another_instance_are_neither_counted_nor_deleted() {
    let mut other = World::new(
        {
            let mut ig = ig(spec("x1"));
            ig.metadata.name = Some("api".into());
            ig
        },
        nodes(&["z"]),
    );
    for _ in 0..5 {
        other.reconcile();
        other.finish_all_done();
        other.edit(|s| s.restart_id.push('r'));
    }
    let mut world = three_nodes("b1");
    world.attempts = other.attempts.clone();
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev1 install canary"]);
    assert!(plan.delete.is_empty(), "not ours: {:?}", plan.delete);
}

// ---------------------------------------------------------------------------
// The attempt object
// ---------------------------------------------------------------------------

#[test]
fn an_attempt_is_a_complete_object_with_a_snapshot_of_the_spec() {
    let mut s = spec("b1");
    s.process.args = vec!["--port=0".into()];
    s.health.path = Some("/healthz".into());
    s.settle.seconds = 30;
    s.stop.timeout_seconds = 5;
    s.resources.pids_max = Some(64);
    s.socket.layout = SocketLayout::Fixed;
    s.config_rev = "c1".into();
    let ig = ig(s);
    let plan = plan(&ig, NO_ATTEMPTS, &nodes(&["a"]), at(T0));
    let [attempt] = plan.create.as_slice() else {
        panic!("one attempt expected, got {}", plan.create.len());
    };

    assert_eq!(attempt.metadata.name.as_deref(), Some("web-a-1"));
    assert_eq!(attempt.metadata.namespace.as_deref(), Some("prod"));
    let labels = attempt.metadata.labels.as_ref().expect("labels");
    assert_eq!(labels.get(LABEL_INSTANCE).map(String::as_str), Some("web"));
    assert_eq!(labels.get(LABEL_NODE).map(String::as_str), Some("a"));
    let owners = attempt
        .metadata
        .owner_references
        .as_ref()
        .expect("an owner");
    assert_eq!(owners.len(), 1);
    assert_eq!(owners[0].api_version, "genswap.dev/v1alpha1");
    assert_eq!(owners[0].kind, "InstanceGeneration");
    assert_eq!(owners[0].name, "web");
    assert_eq!(owners[0].uid, "uid-web");
    assert_eq!(owners[0].controller, Some(true));
    assert_eq!(owners[0].block_owner_deletion, Some(true));

    let spec = &attempt.spec;
    assert_eq!(
        (
            spec.instance.as_str(),
            spec.node_name.as_str(),
            spec.sched_rev
        ),
        ("web", "a", 1)
    );
    assert_eq!((spec.cause, spec.canary), (Cause::Install, true));
    assert_eq!(spec.build, ig.spec.build);
    assert_eq!(spec.mode, ig.spec.mode);
    assert_eq!(spec.kind, ig.spec.kind);
    assert_eq!(spec.demand, ig.spec.demand);
    assert_eq!(spec.config_rev, "c1");
    assert_eq!(spec.restart_id, ig.spec.restart_id);
    assert_eq!(spec.process, ig.spec.process);
    assert_eq!(spec.health, ig.spec.health);
    assert_eq!(spec.settle, ig.spec.settle);
    assert_eq!(spec.stop, ig.spec.stop);
    assert_eq!(spec.resources, ig.spec.resources);
    assert_eq!(spec.socket, ig.spec.socket);

    assert_eq!(
        events(&plan),
        ["AttemptIssued: node a: rev 1, cause install, mode overlap, build b1, canary"]
    );
}

// ---------------------------------------------------------------------------
// Failures: the failure book and halting
// ---------------------------------------------------------------------------

#[test]
fn a_failed_canary_halts_the_rollout_and_stalls() {
    let mut world = three_nodes("b1");
    world.reconcile();
    world.finish("a", failed("unhealthy: GET / answered 503"));

    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(event_reasons(&plan), ["!SwapFailed"]);
    assert_eq!(held(&plan.status), ["b1/overlap@a"]);
    assert_eq!(
        plan.status.held_down[0].reason,
        "unhealthy: GET / answered 503"
    );
    assert_eq!(plan.status.held_down[0].since, time(T0));
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False BuildFailed | Reconciling=False BuildFailed | Stalled=True BuildFailed"
    );
    let stalled = message(&plan.status, "Stalled");
    assert!(
        stalled.contains("build b1 (overlap)")
            && stalled.contains("a (unhealthy: GET / answered 503)")
            && stalled.contains("spec.retry"),
        "{stalled}"
    );
    assert!(
        stalled.contains("; not rolled out: a, b, c;") && !stalled.contains("stopped"),
        "the rollout stopped, not the nodes: {stalled}"
    );

    // Never attempted again on its own, however long we wait.
    world.advance(3600);
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert!(plan.events.is_empty(), "{:?}", events(&plan));
    assert_eq!(plan.requeue_after, None);
}

#[test]
fn a_failure_halts_new_attempts_while_those_in_flight_finish() {
    let mut s = spec("b1");
    s.rollout.canary_nodes = IntOrString::Int(0);
    s.rollout.max_parallel = IntOrString::Int(2);
    let mut world = World::new(ig(s), nodes(&["a", "b", "c"]));
    assert_eq!(
        created(&world.reconcile()),
        ["a rev1 install", "b rev2 install"]
    );

    world.finish("a", failed("exited 1 during settle"));
    let plan = world.reconcile();
    assert!(plan.create.is_empty(), "c must not start");
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False BuildFailed | Reconciling=True RolloutInProgress | Stalled=True BuildFailed"
    );

    world.finish("b", done());
    let plan = world.reconcile();
    assert!(
        plan.create.is_empty(),
        "c must not start after b is done either"
    );
    assert_eq!(
        held(&plan.status),
        ["b1/overlap@a"],
        "b's done lifts nothing"
    );
    assert_eq!(plan.status.ready.as_deref(), Some("1/3"));
    assert_eq!(condition(&plan.status, "Stalled"), "True BuildFailed");
}

#[test]
fn without_halt_on_failure_the_rollout_goes_around_the_failed_node() {
    let mut s = spec("b1");
    s.rollout.halt_on_failure = false;
    let mut world = World::new(ig(s), nodes(&["a", "b", "c"]));
    world.reconcile();
    world.finish("a", failed("unhealthy"));

    let plan = world.reconcile();
    assert_eq!(created(&plan), ["b rev2 install"]);
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False BuildFailed | Reconciling=True RolloutInProgress | Stalled=True BuildFailed"
    );
    world.finish("b", done());
    assert_eq!(created(&world.reconcile()), ["c rev3 install"]);
    world.finish("c", done());

    let plan = world.reconcile();
    assert!(
        plan.create.is_empty(),
        "a is never attempted again on its own"
    );
    assert_eq!(plan.status.ready.as_deref(), Some("2/3"));
    assert_eq!(held(&plan.status), ["b1/overlap@a"]);
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False BuildFailed | Reconciling=False BuildFailed | Stalled=True BuildFailed"
    );
}

#[test]
fn a_hold_that_goes_down_leaves_nothing_serving_and_says_node_down() {
    let mut world = three_nodes("b0");
    world.edit(|s| s.mode = Mode::Hold);
    world.roll_out();
    world.edit(|s| *s = spec_like(&s.clone(), "b1"));
    assert_eq!(created(&world.reconcile()), ["a rev4 release canary"]);

    world.finish("a", down("exited 1 after the old generation stopped"));
    let plan = world.reconcile();
    assert_eq!(event_reasons(&plan), ["!NodeDown"]);
    assert_eq!(held(&plan.status), ["b1/hold@a"]);
    let a = entry(&plan.status, "a");
    assert_eq!(a.build, None, "nothing serves on a");
    assert_eq!(a.generation, Some(1), "the last generation that served");
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False NodeDown | Reconciling=False NodeDown | Stalled=True NodeDown"
    );
    assert!(message(&plan.status, "Stalled").contains("nothing serves on a"));

    // Rolling back to b0 brings a back: it does not serve b0 any more.
    world.edit(|s| *s = spec_like(&s.clone(), "b0"));
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev5 release canary"]);
    assert_eq!(
        condition(&plan.status, "Stalled"),
        "False RolloutInProgress"
    );
}

#[test]
fn a_failure_is_booked_under_the_mode_that_ran() {
    // A fixed socket turns an overlap into a hold: the agent reports it.
    let mut s = spec("b1");
    s.socket.layout = SocketLayout::Fixed;
    let mut world = World::new(ig(s), nodes(&["a"]));
    world.reconcile();
    world.finish("a", failed("unhealthy").ran_as(Mode::Hold));
    assert_eq!(held(&world.reconcile().status), ["b1/hold@a"]);
    // Asking for hold explicitly is the same (build, mode): still held.
    world.edit(|s| s.mode = Mode::Hold);
    assert!(world.reconcile().create.is_empty());

    // With per-generation sockets an overlap failure leaves hold untried.
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    world.reconcile();
    world.finish("a", failed("unhealthy"));
    assert_eq!(held(&world.reconcile().status), ["b1/overlap@a"]);
    world.edit(|s| s.mode = Mode::Hold);
    assert_eq!(created(&world.reconcile()), ["a rev2 install canary"]);
}

#[test]
fn a_new_build_is_not_held_down_and_clears_nothing() {
    let mut world = serving_b0_then("b1");
    world.reconcile();
    world.finish("a", failed("unhealthy"));
    world.reconcile();

    world.edit(|s| *s = spec_like(&s.clone(), "b2"));
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev5 release canary"]);
    assert_eq!(held(&plan.status), ["b1/overlap@a"]);
    world.roll_out();
    let status = world.status();
    assert_eq!(held(&status), ["b1/overlap@a"], "still booked");
    assert_eq!(
        kstatus(&status),
        "Ready=True AllNodesReady | Reconciling=False AllNodesReady | Stalled=False AllNodesReady"
    );
    assert_eq!(status.good_build.as_deref(), Some("b2"));

    // Going back to b1 finds it held down.
    world.edit(|s| *s = spec_like(&s.clone(), "b1"));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(condition(&plan.status, "Stalled"), "True BuildFailed");
}

// ---------------------------------------------------------------------------
// Retry: one attempt per change of spec.retry
// ---------------------------------------------------------------------------

/// b0 serves everywhere, b1 failed on the canary a and is held down.
fn held_b1() -> World {
    let mut world = serving_b0_then("b1");
    assert_eq!(created(&world.reconcile()), ["a rev4 release canary"]);
    world.finish("a", failed("unhealthy"));
    world.reconcile();
    assert_eq!(held(&world.status()), ["b1/overlap@a"]);
    world
}

#[test]
fn a_retry_change_arms_one_attempt_and_done_lifts_the_hold() {
    let mut world = held_b1();
    world.edit(|s| s.retry = "1".into());
    let plan = world.reconcile();
    assert_eq!(event_reasons(&plan), ["RetryArmed", "AttemptIssued"]);
    assert_eq!(created(&plan), ["a rev5 retry canary"]);
    assert_eq!(held(&plan.status), ["b1/overlap@a armed"]);
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False RolloutInProgress | Reconciling=True RetryingHeldBuild | Stalled=False RolloutInProgress"
    );
    assert!(
        world.reconcile().create.is_empty(),
        "one attempt, not one per plan"
    );

    world.finish("a", done());
    let plan = world.reconcile();
    assert!(held(&plan.status).is_empty(), "the hold is lifted");
    assert_eq!(
        created(&plan),
        ["b rev6 release"],
        "and the rollout goes on"
    );
}

#[test]
fn a_retry_that_fails_again_stays_held_down() {
    let mut world = held_b1();
    world.edit(|s| s.retry = "1".into());
    world.reconcile();
    world.finish("a", failed("unhealthy again"));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(held(&plan.status), ["b1/overlap@a"]);
    assert_eq!(plan.status.held_down[0].reason, "unhealthy again");
    assert_eq!(condition(&plan.status, "Stalled"), "True BuildFailed");

    // A further change arms it once more.
    world.edit(|s| s.retry = "2".into());
    assert_eq!(created(&world.reconcile()), ["a rev6 retry canary"]);
}

#[test]
fn a_retry_abandoned_before_anything_ran_is_re_armed_after_a_backoff() {
    let mut world = held_b1();
    world.edit(|s| s.retry = "1".into());
    world.reconcile();
    world.finish("a", abandoned(false));

    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(held(&plan.status), ["b1/overlap@a armed"], "not spent");
    assert_eq!(plan.requeue_after, Some(Duration::from_secs(5)));
    world.advance(5);
    assert_eq!(created(&world.reconcile()), ["a rev6 retry canary"]);
}

#[test]
fn a_retry_abandoned_after_the_build_ran_is_spent() {
    let mut world = held_b1();
    world.edit(|s| s.retry = "1".into());
    world.reconcile();
    world.finish("a", abandoned(true));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(held(&plan.status), ["b1/overlap@a"]);
    assert_eq!(plan.requeue_after, None);
    assert_eq!(condition(&plan.status, "Stalled"), "True BuildFailed");
    world.advance(600);
    assert!(world.reconcile().create.is_empty());
}

#[test]
fn a_retry_token_set_from_the_start_or_before_the_failure_arms_nothing() {
    let mut s = spec("b1");
    s.retry = "from-the-start".into();
    let mut world = World::new(ig(s), nodes(&["a"]));
    world.reconcile();
    world.finish("a", failed("unhealthy"));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(held(&plan.status), ["b1/overlap@a"]);
    assert_eq!(
        plan.status.last_retry.as_deref(),
        Some("from-the-start"),
        "the token is remembered"
    );

    // A change with nothing held is remembered; it arms no later failure.
    let mut world = three_nodes("b1");
    world.edit(|s| s.retry = "early".into());
    world.reconcile();
    world.finish("a", failed("unhealthy"));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(held(&plan.status), ["b1/overlap@a"]);
}

#[test]
fn a_retry_goes_to_the_first_node_needing_the_build_when_the_failed_one_is_gone() {
    let mut world = held_b1();
    world
        .nodes
        .retain(|n| n.metadata.name.as_deref() != Some("a"));
    world.edit(|s| s.retry = "1".into());
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["b rev5 retry canary"]);
    world.finish("b", done());
    let plan = world.reconcile();
    assert!(held(&plan.status).is_empty());
    assert_eq!(created(&plan), ["c rev6 release"]);
}

#[test]
fn without_halt_on_failure_a_retry_arms_each_failed_node_on_its_own() {
    let mut s = spec("b1");
    s.rollout.halt_on_failure = false;
    let mut world = World::new(ig(s), nodes(&["a", "b", "c"]));
    world.reconcile();
    world.finish("a", failed("unhealthy"));
    assert_eq!(created(&world.reconcile()), ["b rev2 install"]);
    world.finish("b", failed("unhealthy"));
    assert_eq!(created(&world.reconcile()), ["c rev3 install"]);
    world.finish("c", done());
    world.reconcile();
    assert_eq!(held(&world.status()), ["b1/overlap@a", "b1/overlap@b"]);

    world.edit(|s| s.retry = "1".into());
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev4 retry canary", "b rev5 retry"]);
    assert_eq!(
        held(&plan.status),
        ["b1/overlap@a armed", "b1/overlap@b armed"]
    );

    world.finish("a", done());
    world.finish("b", failed("unhealthy again"));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(
        held(&plan.status),
        ["b1/overlap@b"],
        "a's done lifts only a's entry"
    );
    assert_eq!(plan.status.ready.as_deref(), Some("2/3"));
    assert_eq!(condition(&plan.status, "Stalled"), "True BuildFailed");
}

// ---------------------------------------------------------------------------
// Abandoned attempts: re-issued with backoff
// ---------------------------------------------------------------------------

#[test]
fn abandoned_attempts_are_re_issued_with_doubling_backoff() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    world.reconcile();
    let waits: [u64; 9] = [5, 10, 20, 40, 80, 160, 300, 300, 300];
    for (round, wait) in waits.into_iter().enumerate() {
        world.finish("a", abandoned(false));
        let plan = world.reconcile();
        assert!(plan.create.is_empty(), "round {round}: too early");
        assert_eq!(
            plan.requeue_after,
            Some(Duration::from_secs(wait)),
            "round {round}"
        );
        assert_eq!(
            condition(&plan.status, "Reconciling"),
            "True RetryingAbandoned",
            "round {round}"
        );
        let wait_secs = i64::try_from(wait).expect("a small number");
        world.advance(wait_secs - 1);
        assert!(
            world.reconcile().create.is_empty(),
            "round {round}: 1 s early"
        );
        world.advance(1);
        let plan = world.reconcile();
        assert_eq!(
            causes(&plan),
            [Cause::Install],
            "round {round}: a fresh attempt, same cause"
        );
    }
    world.finish("a", done());
    let plan = world.reconcile();
    assert_eq!(plan.status.ready.as_deref(), Some("1/1"));
    assert!(
        world.attempts.len() <= 3,
        "the abandoned run is forgotten once done: {}",
        world.attempts.len()
    );
}

// ---------------------------------------------------------------------------
// Supersession
// ---------------------------------------------------------------------------

#[test]
fn a_new_desired_state_supersedes_the_attempt_in_flight_at_once() {
    let mut world = three_nodes("b1");
    assert_eq!(created(&world.reconcile()), ["a rev1 install canary"]);
    world.edit(|s| *s = spec_like(&s.clone(), "b2"));

    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev2 install canary"]);
    assert_eq!(plan.create[0].spec.build.id, "b2");
    assert_eq!(condition(&plan.status, "Reconciling"), "True Superseding");

    // The agent abandons rev1; nothing is re-issued, rev2 is in flight.
    world.finish_rev(1, abandoned(false));
    let plan = world.reconcile();
    assert!(plan.create.is_empty());
    assert_eq!(event_reasons(&plan), ["SwapAbandoned"]);
    world.finish_rev(2, done());
    assert_eq!(created(&world.reconcile()), ["b rev3 install"]);
}

#[test]
fn supersession_respects_the_cohorts_of_the_new_desired_state() {
    let mut world = serving_b0_then("b1");
    assert_eq!(created(&world.reconcile()), ["a rev4 release canary"]);
    world.finish("a", done());
    assert_eq!(created(&world.reconcile()), ["b rev5 release"]);

    world.edit(|s| *s = spec_like(&s.clone(), "b2"));
    let plan = world.reconcile();
    assert_eq!(
        created(&plan),
        ["a rev6 release canary"],
        "b waits for the b2 canary"
    );
    assert_eq!(condition(&plan.status, "Reconciling"), "True Superseding");

    world.finish_rev(5, done());
    assert!(
        world.reconcile().create.is_empty(),
        "the canary is still in flight"
    );
    world.finish("a", done());
    assert_eq!(created(&world.reconcile()), ["b rev7 release"]);
}

#[test]
fn without_canaries_every_node_in_flight_is_superseded_at_once() {
    let mut s = spec("b1");
    s.rollout.canary_nodes = IntOrString::Int(0);
    s.rollout.max_parallel = IntOrString::Int(3);
    let mut world = World::new(ig(s), nodes(&["a", "b", "c"]));
    world.reconcile();
    world.edit(|s| s.config_rev = "c2".into());
    let plan = world.reconcile();
    assert_eq!(
        created(&plan),
        ["a rev4 install", "b rev5 install", "c rev6 install"]
    );
    assert_eq!(condition(&plan.status, "Reconciling"), "True Superseding");
}

#[test]
fn a_rollback_takes_back_a_node_that_an_attempt_is_moving_away() {
    let mut world = serving_b0_then("b1");
    assert_eq!(created(&world.reconcile()), ["a rev4 release canary"]);
    world.edit(|s| *s = spec_like(&s.clone(), "b0"));
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev5 release canary"]);
    assert_eq!(plan.create[0].spec.build.id, "b0");
    assert_eq!(
        kstatus(&plan.status),
        "Ready=True AllNodesReady | Reconciling=True Superseding | Stalled=False AllNodesReady"
    );
}

// ---------------------------------------------------------------------------
// Events exactly once, late outcomes
// ---------------------------------------------------------------------------

#[test]
fn each_outcome_is_announced_once() {
    let mut world = three_nodes("b1");
    world.reconcile();
    world.finish("a", done());
    let first = world.reconcile();
    assert_eq!(
        events(&first),
        [
            "SwapDone: node a: rev 1 done: build b1 serves as generation 1 (overlap, install)",
            "AttemptIssued: node b: rev 2, cause install, mode overlap, build b1",
        ]
    );
    let again = world.reconcile();
    assert!(again.events.is_empty(), "{:?}", events(&again));
}

#[test]
fn an_outcome_below_the_recorded_revision_is_not_announced() {
    let mut world = three_nodes("b1");
    world.reconcile();
    world.edit(|s| *s = spec_like(&s.clone(), "b2"));
    world.reconcile();
    world.finish_rev(2, done());
    world.reconcile();
    world.finish_rev(1, abandoned(false));
    let plan = world.reconcile();
    assert!(
        !event_reasons(&plan).contains(&"SwapAbandoned".to_string()),
        "{:?}",
        events(&plan)
    );
    assert_eq!(
        entry(&plan.status, "a")
            .last_attempt
            .as_ref()
            .map(|l| l.sched_rev),
        Some(2)
    );
}

#[test]
fn a_late_done_still_updates_what_the_node_serves() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    world.reconcile();
    world.edit(|s| *s = spec_like(&s.clone(), "b2"));
    world.reconcile();
    // rev2 is abandoned first; rev1, already past its switch, reports done later.
    world.finish_rev(2, abandoned(false));
    world.reconcile();
    world.finish_rev(1, done());
    let plan = world.reconcile();
    let a = entry(&plan.status, "a");
    assert_eq!((a.build.as_deref(), a.generation), (Some("b1"), Some(2)));
    assert_eq!(event_reasons(&plan), ["SwapDone"]);
    assert!(world.reconcile().events.is_empty(), "announced once");
}

// ---------------------------------------------------------------------------
// goodBuild, garbage collection, transition times, revisions
// ---------------------------------------------------------------------------

#[test]
fn good_build_is_the_newest_build_done_on_every_node() {
    let mut world = serving_b0_then("b1");
    assert_eq!(world.status().good_build.as_deref(), Some("b0"));
    world.reconcile();
    world.finish("a", done());
    assert_eq!(world.reconcile().status.good_build.as_deref(), Some("b0"));
    world.roll_out();
    assert_eq!(world.status().good_build.as_deref(), Some("b1"));
}

#[test]
fn at_rest_a_node_keeps_only_the_attempt_that_carries_its_record() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    world.roll_out();
    for config in ["c1", "c2", "c3", "c4"] {
        world.edit(|s| s.config_rev = config.into());
        world.roll_out();
    }
    let mut names: Vec<String> = world
        .attempts
        .iter()
        .filter_map(|a| a.metadata.name.clone())
        .collect();
    names.sort();
    assert_eq!(names, ["web-a-5"]);
    let record = NodeRecord::on(&world.attempts[0], "a").expect("web-a-5 carries a's record");
    assert_eq!(record.node.config_rev.as_deref(), Some("c4"));
    assert_eq!(record.node.last_attempt.map(|l| l.sched_rev), Some(5));
}

#[test]
fn conditions_keep_their_transition_time_while_their_status_holds() {
    let mut world = three_nodes("b1");
    let ready_since = |world: &World| {
        world
            .status()
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .map(|c| c.last_transition_time.clone())
    };
    world.reconcile();
    assert_eq!(ready_since(&world), Some(time(T0)));
    world.advance(10);
    world.finish_all_done();
    world.reconcile();
    assert_eq!(ready_since(&world), Some(time(T0)), "still False");
    world.advance(10);
    world.roll_out();
    assert_eq!(ready_since(&world), Some(time(T0 + 20)), "became True");
}

#[test]
fn a_revision_above_the_status_is_never_reused() {
    let mut world = three_nodes("b1");
    world.reconcile();
    // An attempt exists with revision 9 while the status says 1: push past it.
    let stored = &mut world.attempts[0];
    stored.spec.sched_rev = 9;
    stored.metadata.name = Some("web-a-9".into());
    world.issued = vec![9];
    world.finish("a", done());
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["b rev10 install"]);
    assert_eq!(plan.status.sched_rev, 10);
}

// ---------------------------------------------------------------------------
// Node records and the bounded status
// ---------------------------------------------------------------------------

/// The record on `node`'s one attempt, and how many attempts it has.
fn record_of(world: &World, node: &str) -> (NodeRecord, usize) {
    let attempts: Vec<_> = world
        .attempts
        .iter()
        .filter(|a| a.spec.node_name == node)
        .collect();
    let record = attempts
        .iter()
        .rev()
        .find_map(|a| NodeRecord::on(a, node))
        .unwrap_or_else(|| panic!("no attempt on {node} carries its record"));
    (record, attempts.len())
}

/// 150 nodes, halt off: the first 120 fail with `reason`, the rest serve.
fn fleet_failing_with(reason: &str) -> (World, Vec<String>) {
    let names: Vec<String> = (0..150).map(|i| format!("n{i:03}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut s = spec("b1");
    s.rollout.canary_nodes = IntOrString::Int(0);
    s.rollout.max_parallel = IntOrString::Int(150);
    s.rollout.halt_on_failure = false;
    let mut world = World::new(ig(s), nodes(&refs));
    assert_eq!(world.reconcile().create.len(), 150);
    for name in &names[..120] {
        world.finish(name, failed(reason));
    }
    for name in &names[120..] {
        world.finish(name, done());
    }
    world.reconcile();
    world.reconcile();
    (world, names)
}

#[test]
fn the_status_lists_at_most_a_hundred_nodes_and_counts_them_all() {
    let (world, names) = fleet_failing_with("unhealthy");
    let status = world.status();
    let counts = status.counts.clone().expect("counts");
    assert_eq!(
        (
            counts.selected,
            counts.ready,
            counts.updated,
            counts.stalled
        ),
        (150, 30, 30, 120)
    );
    assert_eq!((counts.held_down, counts.attention), (120, 120));
    assert_eq!(status.nodes.len(), 100);
    assert!(
        status.nodes.iter().all(|n| n
            .attention
            .as_deref()
            .is_some_and(|why| why.contains("build b1 failed here: unhealthy"))),
        "the nodes that need attention come first, with why"
    );
    assert_eq!(status.held_down.len(), 100);

    // Every node's own memory is on its one attempt.
    for name in &names[..120] {
        let (record, attempts) = record_of(&world, name);
        assert_eq!(attempts, 1);
        assert_eq!(record.held_down.len(), 1, "{name} carries its hold");
        let last = record.node.last_attempt.expect("the failure is recorded");
        assert_eq!(last.outcome, Outcome::Failed);
    }
    let (record, _) = record_of(&world, &names[149]);
    assert_eq!(record.node.build.as_deref(), Some("b1"));
    assert!(record.held_down.is_empty());
}

#[test]
fn long_reasons_are_cut_and_the_lists_kept_within_their_bytes() {
    let (world, _) = fleet_failing_with(&format!("unhealthy: {}", "x".repeat(2000)));
    let status = world.status();
    let bytes = serde_json::to_vec(&status)
        .expect("a status serializes")
        .len();
    assert!(bytes < 64 * 1024, "the status is {bytes} bytes");
    assert!(!status.nodes.is_empty() && status.nodes.len() < 100);
    assert!(!status.held_down.is_empty() && status.held_down.len() < 100);
    assert!(
        status.nodes.iter().all(|n| n
            .last_attempt
            .as_ref()
            .is_some_and(|l| l.reason.len() < 300)),
        "a listed reason is cut"
    );
    assert_eq!(
        status.counts.expect("counts").held_down,
        120,
        "the count is whole"
    );
}

#[test]
fn a_failure_after_a_done_leaves_the_done_attempt_carrying_the_hold_and_the_failed_one_beside_it() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a"]));
    world.roll_out();
    world.edit(|s| s.build = spec("b2").build);
    assert_eq!(created(&world.reconcile()), ["a rev2 release canary"]);
    world.finish("a", failed("unhealthy"));
    let plan = world.reconcile();
    assert_eq!(event_reasons(&plan), ["!SwapFailed"]);
    assert_eq!(plan.records.len(), 1);
    assert_eq!(
        plan.records[0].attempt, "web-a-1",
        "the generation that serves"
    );
    let plan = world.reconcile();
    assert!(
        plan.delete.is_empty(),
        "the failed attempt stays, for the steps and conditions that explain it"
    );
    assert!(plan.events.is_empty(), "announced once");

    let (record, attempts) = record_of(&world, "a");
    assert_eq!(attempts, 2);
    assert_eq!(record.node.build.as_deref(), Some("b1"));
    assert_eq!(record.held_down.len(), 1);
    assert_eq!(held(&world.status()), ["b2/overlap@a"]);

    world.edit(|s| s.retry = "1".into());
    assert_eq!(created(&world.reconcile()), ["a rev3 retry canary"]);
    assert_eq!(
        world.reconcile().delete,
        ["web-a-2"],
        "a newer attempt replaces the failed one"
    );
    world.finish("a", done());
    world.roll_out();
    let (record, attempts) = record_of(&world, "a");
    assert_eq!((attempts, record.node.build.as_deref()), (1, Some("b2")));
    assert!(record.held_down.is_empty() && world.status().held_down.is_empty());
}

#[test]
fn attempts_without_records_are_read_from_the_status_written_before_records() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b"]));
    world.roll_out();
    world.edit(|s| s.config_rev = "c2".into());
    world.reconcile();
    world.finish("a", done());
    world.reconcile();
    world.finish("b", done());
    // As a controller from before records left them: entries in the
    // status, none on the attempts, and b's outcome not recorded yet.
    for attempt in &mut world.attempts {
        attempt.metadata.annotations = None;
    }
    assert_eq!(world.attempts.len(), 4);

    let plan = world.reconcile();
    let announced: Vec<&str> = plan.events.iter().map(|e| e.message.as_str()).collect();
    assert_eq!(
        announced,
        ["node b: rev 4 done: build b1 serves as generation 2 (overlap, config)"],
        "only what the status had not recorded"
    );
    assert!(
        plan.delete.is_empty(),
        "nothing goes before its record is seen"
    );
    assert_eq!(plan.records.len(), 2);
    world.roll_out();
    assert_eq!(world.attempts.len(), 2);
    assert_eq!(
        record_of(&world, "b").0.node.config_rev.as_deref(),
        Some("c2")
    );
}
