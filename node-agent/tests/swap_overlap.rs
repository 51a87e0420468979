//! Overlap swaps on real cgroup v2 with real testapp processes: the rows of
//! issue 3 that run in overlap mode.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{Mode, Outcome};
use node_agent::engine::Step;
use swap_host::{SwapHost, knob};

#[tokio::test]
async fn overlap_done_switches_to_the_successor_and_retires_the_incumbent() {
    let host = SwapHost::new("overlap-done");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");
    assert_eq!(before.build, "b1");

    let b2 = host.build("b2");
    let result = host.swap(&host.attempt(2, &b2, "b2")).await;

    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(result.effective_mode, Mode::Overlap);
    assert!(result.executed);
    assert!(!result.clean_exit);
    assert_eq!(result.generation, Some(before.generation + 1));
    assert!(
        result.drain.is_some(),
        "the retiring generation's drain is reported"
    );
    let steps: Vec<Step> = result.steps.iter().map(|s| s.step).collect();
    for step in [
        Step::Stage,
        Step::Admit,
        Step::Raise,
        Step::Journal,
        Step::Spawn,
        Step::Health,
        Step::Switch,
        Step::Retire,
    ] {
        assert!(steps.contains(&step), "{step} missing from {steps:?}");
    }
    let after = host.who_serves().await.expect("b2 serves");
    assert_eq!(after.build, "b2");
    assert_eq!(Some(after.generation), result.generation);
    assert!(!swap_host::alive(before.pid), "the incumbent was stopped");
    host.assert_only(result.generation);
    host.tear_down().await;
}

#[tokio::test]
async fn successor_answering_500_fails_and_the_incumbent_keeps_serving() {
    let host = SwapHost::new("overlap-500");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    knob(&mut attempt, "TESTAPP_STATUS", "500");
    attempt.spec.health.timeout_seconds = 2;
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(result.executed);
    assert!(result.reason.contains("500"), "{}", result.reason);
    assert_eq!(host.who_serves().await, Some(before.clone()));
    host.assert_only(Some(before.generation));
    host.tear_down().await;
}
