//! Overlap swaps on real cgroup v2 with real testapp processes: the rows of
//! issue 3 that run in overlap mode.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::time::Duration;

use genswap_crds::{Mode, Outcome};
use node_agent::classify::StepOutcome;
use node_agent::engine::{Cancel, Step};
use node_agent::gate::GatePoint;
use swap_host::{SupersedeAt, SwapHost, knob};

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
    // Long enough for the build to bind and answer 500 on a loaded machine.
    attempt.spec.health.timeout_seconds = 5;
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(result.executed);
    assert!(result.reason.contains("500"), "{}", result.reason);
    host.assert_still_serves(&before).await;
    host.tear_down().await;
}

#[tokio::test]
async fn successor_exiting_inside_the_settle_window_fails() {
    let host = SwapHost::new("overlap-settle-exit");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.canary = true;
    attempt.spec.settle.seconds = 20;
    // Long enough to be healthy first, even on a loaded machine.
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "3000");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "3");
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(result.executed);
    assert!(
        result.reason.contains("inside the settle window"),
        "{}",
        result.reason
    );
    let settle = result
        .steps
        .iter()
        .find(|s| s.step == Step::Settle)
        .expect("a settle step");
    assert_eq!(settle.result, StepOutcome::Failed);
    host.assert_still_serves(&before).await;
    host.tear_down().await;
}

#[tokio::test]
async fn superseded_before_the_exec_is_abandoned_with_nothing_executed() {
    let host = SwapHost::new("overlap-superseded-exec");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let gate = SupersedeAt::new(GatePoint::Exec);
    let result = host
        .engine
        .swap(&host.attempt(2, &b2, "b2"), &gate, &Cancel::new())
        .await;

    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed, "nothing of b2 ran: {result:?}");
    assert!(result.reason.contains("superseded"), "{}", result.reason);
    assert_eq!(gate.asked(), vec![GatePoint::Admission, GatePoint::Exec]);
    host.assert_still_serves(&before).await;
    host.tear_down().await;
}

#[tokio::test]
async fn superseded_at_the_switch_stops_the_successor_and_keeps_the_incumbent() {
    let host = SwapHost::new("overlap-superseded-switch");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let gate = SupersedeAt::new(GatePoint::Switch);
    let result = host
        .engine
        .swap(&host.attempt(2, &b2, "b2"), &gate, &Cancel::new())
        .await;

    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(result.executed, "b2 ran before the refusal: {result:?}");
    assert!(result.reason.contains("superseded"), "{}", result.reason);
    assert_eq!(
        gate.asked(),
        vec![GatePoint::Admission, GatePoint::Exec, GatePoint::Switch]
    );
    host.assert_still_serves(&before).await;
    host.tear_down().await;
}

#[tokio::test]
async fn an_incumbent_ignoring_sigterm_is_killed_at_the_stop_timeout() {
    let host = SwapHost::new("overlap-ignore-sigterm");
    host.install_with(1, "b1", |a| knob(a, "TESTAPP_IGNORE_SIGTERM", "1"))
        .await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.stop.timeout_seconds = 1;
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let drain = result.drain.expect("a drain time");
    assert!(
        drain >= Duration::from_secs(1),
        "it ignored SIGTERM for the whole stop timeout: {drain:?}"
    );
    assert!(result.drain_ms().is_some_and(|ms| ms >= 1000));
    assert!(result.reason.contains("killed"), "{}", result.reason);
    assert!(!swap_host::alive(before.pid), "proven exit");
    assert_eq!(host.who_serves().await.map(|i| i.build), Some("b2".into()));
    host.assert_only(result.generation);
    host.tear_down().await;
}

#[tokio::test]
async fn forked_grandchildren_die_with_the_retiring_cgroup() {
    let host = SwapHost::new("overlap-grandchildren");
    host.install_with(1, "b1", |a| knob(a, "TESTAPP_FORK_CHILDREN", "3"))
        .await;
    let before = host.who_serves().await.expect("b1 serves");
    let gen1 = host
        .instance_cgroup()
        .join(format!("gen-{}", before.generation));
    let family: Vec<u32> = std::fs::read_to_string(gen1.join("cgroup.procs"))
        .expect("gen-1 procs")
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect();
    assert_eq!(family.len(), 4, "b1 and its three children: {family:?}");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.stop.timeout_seconds = 1;
    let result = host.swap(&attempt).await;

    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    for pid in family {
        assert!(!swap_host::alive(pid), "pid {pid} of generation 1 survived");
    }
    host.assert_only(result.generation);
    host.tear_down().await;
}

#[tokio::test]
async fn a_cancelled_attempt_is_abandoned_and_its_successor_stopped() {
    let host = SwapHost::new("overlap-cancelled");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");

    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    // Never healthy: the attempt waits in its health step until cancelled.
    knob(&mut attempt, "TESTAPP_NEVER_BIND", "1");
    let cancel = Cancel::new();
    let canceller = {
        let cancel = cancel.clone();
        let gen2 = host.instance_cgroup().join("gen-2");
        tokio::spawn(async move {
            swap_host::eventually("generation 2 running", || {
                std::fs::read_to_string(gen2.join("cgroup.procs")).is_ok_and(|p| !p.is_empty())
            })
            .await;
            cancel.cancel("the agent is shutting down");
        })
    };
    let result = host
        .engine
        .swap(&attempt, &swap_host::OpenGate, &cancel)
        .await;
    canceller.await.expect("the canceller");

    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(result.executed, "b2 had started");
    assert!(result.reason.contains("shutting down"), "{}", result.reason);
    let health = result
        .steps
        .iter()
        .find(|s| s.step == Step::Health)
        .expect("a health step");
    assert_eq!(health.result, StepOutcome::Cancelled);
    host.assert_still_serves(&before).await;
    host.tear_down().await;
}

#[tokio::test]
async fn the_outcome_stays_in_the_journal_until_acknowledged() {
    let host = SwapHost::new("overlap-journal");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    let result = host.swap(&host.attempt(2, &b2, "b2")).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");

    let journal = host.engine.journal();
    let pending = journal.pending_reports().expect("pending reports");
    let revs: Vec<i64> = pending.iter().map(|r| r.attempt.sched_rev).collect();
    assert_eq!(revs, vec![1, 2], "both outcomes wait for their report");
    let kept = pending[1].outcome.as_ref().expect("an outcome");
    assert_eq!(kept.outcome, Outcome::Done);
    assert_eq!(kept.generation, result.generation);
    assert_eq!(kept.executed, result.executed);
    assert_eq!(kept.steps, result.step_timings());
    let serving = journal
        .serving(&host.instance)
        .expect("journal")
        .expect("a serving generation");
    assert_eq!(Some(serving.n), result.generation);

    assert!(journal.acknowledge(&host.instance, 1).expect("ack 1"));
    assert!(journal.acknowledge(&host.instance, 2).expect("ack 2"));
    assert!(journal.pending_reports().expect("pending").is_empty());
    host.tear_down().await;
}
