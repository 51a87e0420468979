//! Hold swaps and workers (SPEC 5.6), and the overlaps that must run as
//! holds (SPEC 5.2), on real cgroup v2 with real testapp processes.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{InstanceKind, Mode, Outcome, SocketLayout};
use node_agent::engine::Step;
use swap_host::{SwapHost, knob};

#[tokio::test]
async fn hold_done_stops_the_incumbent_then_starts_the_successor() {
    let host = SwapHost::new("hold-done");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.mode = Mode::Hold;
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(result.effective_mode, Mode::Hold);
    assert!(result.executed);
    assert!(result.drain.is_some(), "the incumbent's stop is reported");
    let steps: Vec<Step> = result.steps.iter().map(|s| s.step).collect();
    let stop = steps
        .iter()
        .position(|s| *s == Step::Stop)
        .expect("a stop step");
    let spawn = steps
        .iter()
        .position(|s| *s == Step::Spawn)
        .expect("a spawn step");
    assert!(stop < spawn, "stop before spawn: {steps:?}");
    assert!(!steps.contains(&Step::Retire), "{steps:?}");
    assert!(!swap_host::alive(before.pid));
    let after = host.who_serves().await.expect("b2 serves");
    assert_eq!(
        (after.build.as_str(), Some(after.generation)),
        ("b2", result.generation)
    );
    host.assert_only(result.generation);
    host.tear_down().await;
}

#[tokio::test]
async fn hold_whose_new_build_fails_is_down_and_nothing_serves() {
    let host = SwapHost::new("hold-down");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.mode = Mode::Hold;
    attempt.spec.health.timeout_seconds = 2;
    knob(&mut attempt, "TESTAPP_STATUS", "500");
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Down, "{result:?}");
    assert_eq!(result.effective_mode, Mode::Hold);
    assert!(result.executed);
    assert!(
        result.reason.contains("nothing serves"),
        "{}",
        result.reason
    );
    assert!(!swap_host::alive(before.pid));
    assert_eq!(host.who_serves().await, None);
    assert!(
        !host.current_sock().exists(),
        "current.sock names nothing dead"
    );
    assert_eq!(host.engine.serving(&host.instance), None);
    host.assert_only(None);
}

#[tokio::test]
async fn a_worker_one_shot_exiting_0_in_the_window_is_done_with_a_clean_exit() {
    let host = SwapHost::new("worker-one-shot");
    host.install_with(1, "w1", |a| a.spec.kind = InstanceKind::Worker)
        .await;
    let before = host.who_serves().await.expect("w1 runs");

    let w2 = host.build("w2");
    let mut attempt = host.attempt(2, &w2, "w2");
    attempt.spec.kind = InstanceKind::Worker;
    attempt.spec.settle.seconds = 20;
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "1000");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "0");
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(result.clean_exit, "{result:?}");
    assert_eq!(result.effective_mode, Mode::Hold, "workers stop then start");
    assert!(result.executed);
    assert!(!swap_host::alive(before.pid));
    assert_eq!(
        host.who_serves().await,
        None,
        "a one-shot leaves nothing serving"
    );
    host.assert_only(None);
}

#[tokio::test]
async fn a_worker_exiting_non_zero_in_the_window_is_down() {
    let host = SwapHost::new("worker-crash");
    host.install_with(1, "w1", |a| a.spec.kind = InstanceKind::Worker)
        .await;

    let w2 = host.build("w2");
    let mut attempt = host.attempt(2, &w2, "w2");
    attempt.spec.kind = InstanceKind::Worker;
    attempt.spec.settle.seconds = 20;
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "1000");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "1");
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Down, "{result:?}");
    assert!(!result.clean_exit);
    assert_eq!(host.who_serves().await, None);
    host.assert_only(None);
}

#[tokio::test]
async fn an_overlap_of_a_fixed_socket_layout_runs_as_a_hold() {
    let host = SwapHost::new("fixed-layout");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.socket.layout = SocketLayout::Fixed;
    assert_eq!(attempt.spec.mode, Mode::Overlap);
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(result.effective_mode, Mode::Hold);
    let steps: Vec<Step> = result.steps.iter().map(|s| s.step).collect();
    assert!(
        steps.contains(&Step::Stop) && !steps.contains(&Step::Retire),
        "{steps:?}"
    );
    assert!(!swap_host::alive(before.pid));
    assert_eq!(host.who_serves().await.map(|i| i.build), Some("b2".into()));
    let record = host
        .engine
        .journal()
        .load(&host.instance)
        .expect("journal")
        .expect("the attempt's record");
    assert_eq!(
        record.effective_mode,
        Mode::Hold,
        "journaled as the mode that ran"
    );
    host.assert_only(result.generation);
    host.tear_down().await;
}

#[tokio::test]
async fn an_install_with_nothing_serving_starts_the_build() {
    let host = SwapHost::new("install");
    let b1 = host.build("b1");
    let result = host.swap(&host.attempt(1, &b1, "b1")).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(result.drain, None, "nothing was stopped");
    assert_eq!(result.generation, Some(1));
    assert_eq!(host.who_serves().await.map(|i| i.build), Some("b1".into()));
    host.assert_only(Some(1));
    host.tear_down().await;
}
