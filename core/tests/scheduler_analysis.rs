//! A canary judged by its metrics (SPEC 4.3, `rollout.analysis`) and
//! failed nodes restored (`rollout.onFailure: restore`), in the scheduler:
//! Prometheus's answers are given, as the adapters pass them in.

mod scheduler_support;

use genswap_core::scheduler::{AnalysisRequest, Answer, Plan};
use genswap_crds::{
    AnalysisPhase, AnalysisQuery, AnalysisSpec, AnalysisStatus, Cause, Inconclusive, Mode,
    OnFailure,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use scheduler_support::*;

const ERROR_RATE: &str = r#"sum(rate(http_requests_total{node=~"$node",build="$build",code=~"5.."}[1m])) / sum(rate(http_requests_total{node=~"$node",build="$build"}[1m]))"#;

fn analysis(count: i32) -> AnalysisSpec {
    AnalysisSpec {
        queries: vec![AnalysisQuery {
            name: "error-rate".into(),
            query: ERROR_RATE.into(),
            min: None,
            max: Some(0.01),
        }],
        interval_seconds: 30,
        count,
        failure_limit: 0,
        every_wave: false,
        inconclusive: Inconclusive::Halt,
    }
}

fn answering(value: f64) -> impl Fn(&AnalysisRequest) -> Vec<Answer> {
    move |request| {
        request
            .queries
            .iter()
            .map(|_| Answer::Samples(vec![("{}".into(), value)]))
            .collect()
    }
}

fn record(plan: &Plan) -> AnalysisStatus {
    plan.status
        .rollout
        .as_ref()
        .and_then(|rollout| rollout.analysis.clone())
        .expect("the status carries the analysis")
}

fn unasked(_: &AnalysisRequest) -> Vec<Answer> {
    panic!("no measurement is due")
}

/// Three nodes serving b1, then a release of b2 judged by `analysis`.
fn released(analysis: AnalysisSpec, on_failure: OnFailure) -> World {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b", "c"]));
    world.roll_out();
    world.edit(|spec| {
        spec.build = scheduler_support::spec("b2").build;
        spec.rollout.analysis = Some(analysis);
        spec.rollout.on_failure = on_failure;
        spec.rollout.max_parallel = IntOrString::Int(2);
    });
    let plan = world.reconcile();
    assert_eq!(created(&plan), ["a rev4 release canary"]);
    world.finish_all_done();
    world
}

#[test]
fn the_canary_is_measured_at_each_interval_before_any_other_node_starts() {
    let mut world = released(analysis(2), OnFailure::Hold);
    let plan = world.reconcile_measuring(unasked);
    assert!(plan.create.is_empty(), "the others wait for the analysis");
    let started = record(&plan);
    assert_eq!(
        (
            started.build.as_str(),
            started.wave.as_str(),
            started.phase,
            started.measurements
        ),
        ("b2", "canary", AnalysisPhase::Running, 0)
    );
    assert_eq!(
        plan.requeue_after,
        Some(std::time::Duration::from_secs(31)),
        "the first measurement is one interval after the end of the second the canary took over in"
    );
    assert!(
        message(&plan.status, "Reconciling").contains("judged by rollout.analysis: 0 of 2"),
        "{}",
        message(&plan.status, "Reconciling")
    );

    world.advance(31);
    let mut asked = Vec::new();
    let plan = world.reconcile_measuring(|request| {
        asked.push(request.queries[0].promql.clone());
        answering(0.0)(request)
    });
    assert_eq!(
        asked,
        [
            r#"sum(rate(http_requests_total{node=~"a",build="b2",code=~"5.."}[1m])) / sum(rate(http_requests_total{node=~"a",build="b2"}[1m]))"#
        ],
        "$node is the canary, $build the build judged"
    );
    assert_eq!(record(&plan).measurements, 1);
    assert!(plan.create.is_empty(), "one of two measurements");

    world.advance(29);
    assert!(world.reconcile_measuring(unasked).create.is_empty());
    world.advance(1);
    let plan = world.reconcile_measuring(answering(0.004));
    assert_eq!(record(&plan).phase, AnalysisPhase::Passed);
    assert!(event_reasons(&plan).contains(&"AnalysisPassed".to_string()));
    assert_eq!(
        created(&plan),
        ["b rev5 release", "c rev6 release"],
        "the rest go in the same plan"
    );
    world.roll_out();
    assert_eq!(
        kstatus(&world.status()),
        "Ready=True AllNodesReady | Reconciling=False AllNodesReady | Stalled=False AllNodesReady"
    );
}

#[test]
fn a_bound_crossed_halts_the_rollout_with_the_query_value_and_bound() {
    let mut world = released(analysis(3), OnFailure::Hold);
    world.reconcile_measuring(unasked);
    world.advance(31);
    let plan = world.reconcile_measuring(answering(0.05));
    assert!(plan.create.is_empty());
    assert_eq!(record(&plan).phase, AnalysisPhase::Failed);
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False AnalysisFailed | Reconciling=False AnalysisFailed | Stalled=True AnalysisFailed"
    );
    let stalled = message(&plan.status, "Stalled");
    assert!(
        stalled.contains("wave canary of build b2 failed its analysis")
            && stalled.contains("query error-rate gave 0.05 for {}, above its max 0.01"),
        "{stalled}"
    );
    assert_eq!(event_reasons(&plan), ["!AnalysisFailed"]);

    // Halted: nothing more, no deadline on top, no second Event; the
    // canary keeps the build under onFailure: hold.
    world.advance(3600);
    let plan = world.reconcile_measuring(unasked);
    assert!(plan.create.is_empty() && event_reasons(&plan).is_empty());
    assert!(condition(&plan.status, "Stalled").contains("AnalysisFailed"));
    assert_eq!(entry(&plan.status, "a").build.as_deref(), Some("b2"));

    // A new retry token judges the canary again: its wave ended more than
    // an interval ago, so at once.
    world.edit(|spec| spec.retry = "again".into());
    let plan = world.reconcile_measuring(answering(0.0));
    assert_eq!(record(&plan).measurements, 1);
    assert_eq!(record(&plan).phase, AnalysisPhase::Running);
    assert!(condition(&plan.status, "Stalled").starts_with("False "));
}

#[test]
fn a_failed_analysis_restores_the_canary_under_on_failure_restore() {
    let mut world = released(analysis(1), OnFailure::Restore);
    world.reconcile_measuring(unasked);
    world.advance(31);
    let plan = world.reconcile_measuring(answering(0.5));
    assert_eq!(causes(&plan), [Cause::Rollback]);
    let restore = &plan.create[0];
    assert_eq!(
        (
            restore.spec.node_name.as_str(),
            restore.spec.build.id.as_str()
        ),
        ("a", "b1"),
        "the canary gets the good build back"
    );
    assert!(
        message(&plan.status, "Stalled").contains("its nodes are restored to build b1"),
        "{}",
        message(&plan.status, "Stalled")
    );
    world.finish_all_done();
    let plan = world.reconcile_measuring(unasked);
    assert_eq!(entry(&plan.status, "a").build.as_deref(), Some("b1"));
    assert!(plan.create.is_empty(), "b2 stays held: not issued again");
    assert!(condition(&plan.status, "Stalled").contains("AnalysisFailed"));
    world.advance(600);
    assert!(world.reconcile_measuring(unasked).create.is_empty());

    // A retry gives the canary b2 again.
    world.edit(|spec| spec.retry = "fixed-the-metric".into());
    let plan = world.reconcile_measuring(unasked);
    assert_eq!(created(&plan).len(), 1);
    assert_eq!(plan.create[0].spec.build.id, "b2");
}

#[test]
fn a_failed_attempt_is_restored_and_its_build_stays_held() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b"]));
    world.roll_out();
    world.edit(|spec| {
        spec.build = scheduler_support::spec("b2").build;
        spec.mode = Mode::Hold;
        spec.rollout.on_failure = OnFailure::Restore;
    });
    world.reconcile();
    world.finish("a", down("health check timed out"));
    let plan = world.reconcile();
    assert_eq!(causes(&plan), [Cause::Rollback]);
    assert_eq!(plan.create[0].spec.build.id, "b1");
    assert!(
        event_reasons(&plan)
            .iter()
            .any(|reason| reason == "!NodeDown"),
        "{:?}",
        event_reasons(&plan)
    );
    world.finish_all_done();
    let plan = world.reconcile();
    assert!(plan.create.is_empty(), "b2 is held down: no second try");
    assert_eq!(entry(&plan.status, "a").build.as_deref(), Some("b1"));
    assert_eq!(held(&plan.status).len(), 1, "{:?}", held(&plan.status));
    assert!(
        condition(&plan.status, "Stalled").starts_with("True "),
        "a human must still act on b2"
    );
}

#[test]
fn under_on_failure_hold_a_down_node_is_left_down() {
    let mut world = World::new(ig(spec("b1")), nodes(&["a", "b"]));
    world.roll_out();
    world.edit(|spec| {
        spec.build = scheduler_support::spec("b2").build;
        spec.mode = Mode::Hold;
    });
    world.reconcile();
    world.finish("a", down("health check timed out"));
    let plan = world.reconcile();
    assert!(plan.create.is_empty(), "{:?}", created(&plan));
    assert!(condition(&plan.status, "Stalled").contains("NodeDown"));
}

#[test]
fn measurements_nobody_could_take_halt_or_proceed_as_the_spec_says() {
    for (inconclusive, expect) in [
        (Inconclusive::Halt, AnalysisPhase::Inconclusive),
        (Inconclusive::Proceed, AnalysisPhase::Passed),
    ] {
        let mut world = released(
            AnalysisSpec {
                inconclusive,
                ..analysis(1)
            },
            OnFailure::Restore,
        );
        world.reconcile_measuring(unasked);
        world.advance(31);
        let plan = world.reconcile_measuring(|_| {
            vec![Answer::Unanswered(
                "connection refused (127.0.0.1:9090)".into(),
            )]
        });
        assert_eq!(record(&plan).phase, expect, "{inconclusive:?}");
        match expect {
            AnalysisPhase::Inconclusive => {
                assert!(plan.create.is_empty(), "no restore: nothing failed");
                assert!(
                    condition(&plan.status, "Stalled").contains("AnalysisInconclusive"),
                    "{}",
                    condition(&plan.status, "Stalled")
                );
                assert!(message(&plan.status, "Stalled").contains("connection refused"));
            }
            _ => {
                assert_eq!(created(&plan).len(), 2, "the rest go");
                assert!(event_reasons(&plan).contains(&"!AnalysisPassed".to_string()));
            }
        }
    }
}

#[test]
fn every_wave_is_judged_with_every_wave_and_a_wave_passed_stays_passed() {
    let mut s = spec("b1");
    s.rollout.max_parallel = IntOrString::Int(10);
    s.rollout.waves = Some(genswap_crds::WavesSpec {
        by_label: "zone".into(),
        order: Vec::new(),
    });
    s.rollout.analysis = Some(AnalysisSpec {
        every_wave: true,
        ..analysis(1)
    });
    let nodes = vec![
        node("a", &[("zone", "z1")]),
        node("b", &[("zone", "z1")]),
        node("c", &[("zone", "z2")]),
    ];
    let mut world = World::new(ig(s), nodes);
    world.reconcile();
    world.finish_all_done();
    world.reconcile_measuring(unasked);
    world.advance(31);
    let plan = world.reconcile_measuring(answering(0.0));
    assert_eq!(created(&plan), ["b rev2 install"], "z1 after the canary");
    world.finish_all_done();
    let plan = world.reconcile_measuring(unasked);
    assert!(plan.create.is_empty(), "z1 is judged before z2");
    assert_eq!(record(&plan).wave, "z1");
    world.advance(31);
    let mut asked = Vec::new();
    let plan = world.reconcile_measuring(|request| {
        asked.push(request.queries[0].promql.clone());
        answering(0.0)(request)
    });
    assert!(
        asked[0].contains(r#"node=~"b""#),
        "the wave's nodes, not the canary's: {asked:?}"
    );
    assert_eq!(created(&plan), ["c rev3 install"]);
    world.finish_all_done();
    let plan = world.reconcile_measuring(unasked);
    assert_eq!(plan.status.ready.as_deref(), Some("3/3"));
}

/// One node serving b1, then b2 released to it, judged twice, restored
/// on failure; b2's attempt done.
fn one_node_released() -> World {
    let mut world = World::new(ig(spec("b1")), nodes(&["only"]));
    world.roll_out();
    world.edit(|spec| {
        spec.build = scheduler_support::spec("b2").build;
        spec.rollout.analysis = Some(analysis(2));
        spec.rollout.on_failure = OnFailure::Restore;
    });
    world.reconcile();
    world.finish_all_done();
    world
}

#[test]
fn a_single_node_is_judged_too_and_not_ready_until_it_passes() {
    let mut world = one_node_released();
    let plan = world.reconcile_measuring(unasked);
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False AnalysisRunning | Reconciling=True AnalysisRunning | Stalled=False AnalysisRunning"
    );
    assert!(
        message(&plan.status, "Ready").contains("all 1 nodes serve build b2"),
        "{}",
        message(&plan.status, "Ready")
    );
    assert_eq!(
        plan.status.history.first().map(|h| h.build.as_str()),
        Some("b1"),
        "b2 is not a good build before its analysis passed"
    );
    world.advance(31);
    world.reconcile_measuring(answering(0.0));
    world.advance(30);
    let plan = world.reconcile_measuring(answering(0.0));
    assert!(condition(&plan.status, "Ready").starts_with("True AllNodesReady"));
    assert_eq!(
        plan.status.history.first().map(|h| h.build.as_str()),
        Some("b2")
    );
}

#[test]
fn a_single_node_that_fails_its_analysis_gets_the_good_build_back() {
    let mut world = one_node_released();
    world.reconcile_measuring(unasked);
    world.advance(31);
    let plan = world.reconcile_measuring(answering(1.0));
    assert_eq!(causes(&plan), [Cause::Rollback]);
    assert_eq!(plan.create[0].spec.build.id, "b1");
    world.finish_all_done();
    let plan = world.reconcile_measuring(unasked);
    assert_eq!(entry(&plan.status, "only").build.as_deref(), Some("b1"));
    assert_eq!(
        kstatus(&plan.status),
        "Ready=False AnalysisFailed | Reconciling=False AnalysisFailed | Stalled=True AnalysisFailed"
    );
}

#[test]
fn an_abandoned_restore_after_a_failed_analysis_is_issued_again() {
    let mut world = one_node_released();
    world.reconcile_measuring(unasked);
    world.advance(31);
    let plan = world.reconcile_measuring(answering(1.0));
    assert_eq!(causes(&plan), [Cause::Rollback]);
    world.finish("only", abandoned(false));
    let plan = world.reconcile_measuring(unasked);
    assert!(plan.create.is_empty(), "the backoff first");
    world.advance(6);
    let plan = world.reconcile_measuring(unasked);
    assert_eq!(causes(&plan), [Cause::Rollback]);
    assert_eq!(plan.create[0].spec.build.id, "b1");
}

#[test]
fn removing_the_analysis_lifts_its_halt() {
    let mut world = released(analysis(1), OnFailure::Hold);
    world.reconcile_measuring(unasked);
    world.advance(31);
    world.reconcile_measuring(answering(0.5));
    world.edit(|spec| spec.rollout.analysis = None);
    let plan = world.reconcile_measuring(unasked);
    assert_eq!(created(&plan).len(), 2, "the rest go: {:?}", created(&plan));
    assert!(condition(&plan.status, "Stalled").starts_with("False "));
}
