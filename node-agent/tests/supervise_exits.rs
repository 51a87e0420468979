//! Supervision between attempts (SPEC 5.10): a serving generation that
//! exits on its own or is killed is noticed at once (a pidfd, no polling),
//! reaped, cleaned up, journaled, and then restarted or left down as its
//! `restartPolicy` says. Real testapp processes on real cgroup v2.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/supervisor_watch.rs"]
mod supervisor_watch;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use genswap_crds::{InstanceKind, Outcome, RestartPolicy, ServingState};
use node_agent::engine::{Engine, EngineConfig, RestartBackoff};
use node_agent::journal::InstanceEntry;
use swap_host::{SwapHost, knob};

use supervisor_watch::Watching;

/// Kills `pid` (a serving generation's main process) with SIGKILL.
fn sigkill(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the serving generation");
}

fn entry(engine: &Engine, host: &SwapHost) -> InstanceEntry {
    engine
        .journal()
        .load_entry(&host.instance)
        .expect("journal readable")
        .expect("an entry")
}

/// The old process was reaped (no zombie of the agent).
fn assert_reaped(pid: u32) {
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "pid {pid} was reaped, not left a zombie of the agent"
    );
}

/// Nothing of the instance runs and nothing names a dead socket.
fn assert_down(host: &SwapHost) {
    host.assert_only(None);
    assert!(
        std::fs::symlink_metadata(host.current_sock()).is_err(),
        "current.sock no longer names a dead socket"
    );
    assert_eq!(host.engine.serving(&host.instance), None);
}

/// An engine whose restarts wait `initial` doubling to `max` (the reset
/// after 10 minutes up, as by default).
fn backing_off(initial: Duration, max: Duration) -> EngineConfig {
    EngineConfig {
        restart_backoff: RestartBackoff {
            initial,
            max,
            ..RestartBackoff::default()
        },
        ..EngineConfig::default()
    }
}

/// A file a `nobody` instance may create: `TESTAPP_EXIT_ONCE`.
fn once_file(host: &SwapHost) -> PathBuf {
    let dir = host.staging.with_file_name("once");
    std::fs::create_dir_all(&dir).expect("once dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("open it");
    dir.join("exited")
}

#[tokio::test]
async fn a_killed_serving_generation_is_restarted_and_serves_through_current_sock() {
    let host = SwapHost::new("supervise-kill");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");
    let mut watching = Watching::start(&host.engine);

    sigkill(before.pid);
    let exit = watching.exit().await;
    assert_eq!(exit.instance, host.instance);
    assert_eq!((exit.exit.generation, exit.exit.build.as_str()), (1, "b1"));
    assert_eq!((exit.exit.exit_code, exit.exit.signal), (None, Some(9)));
    assert!(!exit.exit.oom_killed, "no memory controller here, no OOM");
    assert_eq!(exit.reason(), "signaled");
    assert_eq!(exit.describe(), "signal 9 (SIGKILL)");

    let states = watching.states_until_restarts(1).await;
    let down = &states[0];
    assert_eq!(down.supervised.state, ServingState::Exited, "{states:?}");
    assert_eq!(down.supervised.generation, 1);
    assert_eq!(down.last_exit.as_ref(), Some(&exit.exit));
    let message = down.supervised.message.clone().unwrap_or_default();
    assert!(
        message.contains("signal 9 (SIGKILL); restarting it"),
        "{message}"
    );
    let up = states.last().expect("a state");
    assert_eq!(
        (up.supervised.generation, up.supervised.restarts),
        (2, 1),
        "{states:?}"
    );
    assert_eq!(
        up.supervised.attempt.sched_rev, 1,
        "it reports to the attempt that installed b1"
    );

    let after = host
        .who_serves()
        .await
        .expect("the restart answers through current.sock");
    assert_eq!((after.build.as_str(), after.generation), ("b1", 2));
    assert_ne!(after.pid, before.pid);
    assert_reaped(before.pid);
    host.assert_only(Some(2));
    let journaled = entry(&host.engine, &host);
    assert_eq!(journaled.serving.as_ref().map(|g| g.n), Some(2));
    assert_eq!(
        journaled.last_exit.as_ref().map(|e| e.signal),
        Some(Some(9))
    );
    let pending: Vec<(i64, Option<u32>)> = journaled
        .pending_reports()
        .iter()
        .map(|r| (r.attempt.sched_rev, r.restart))
        .collect();
    assert_eq!(
        pending,
        [(1, None)],
        "only the install's outcome waits for its report; a restart is never reported as it"
    );
    drop(watching);
    host.tear_down().await;
}

#[tokio::test]
async fn a_server_exiting_0_is_restarted_under_always() {
    let host = SwapHost::new("supervise-exit0");
    let once = once_file(&host);
    host.install_with(1, "b1", |attempt| {
        knob(attempt, "TESTAPP_EXIT_AFTER_MS", "1500");
        knob(attempt, "TESTAPP_EXIT_CODE", "0");
        knob(attempt, "TESTAPP_EXIT_ONCE", &once.display().to_string());
        if let Some(dir) = once.parent() {
            swap_host::writable(attempt, dir);
        }
    })
    .await;
    let before = host.who_serves().await.expect("b1 serves");
    let mut watching = Watching::start(&host.engine);
    let exit = watching.exit().await;
    assert_eq!((exit.exit.exit_code, exit.exit.signal), (Some(0), None));
    assert_eq!(exit.describe(), "exit code 0");
    watching.states_until_restarts(1).await;
    let after = host.who_serves().await.expect("the restart serves");
    assert_eq!(after.generation, 2);
    assert_reaped(before.pid);
    drop(watching);
    host.tear_down().await;
}

#[tokio::test]
async fn never_leaves_an_exited_generation_down_and_says_so() {
    let host = SwapHost::new("supervise-never");
    host.install_with(1, "b1", |attempt| {
        attempt.spec.restart_policy = Some(RestartPolicy::Never);
        knob(attempt, "TESTAPP_EXIT_AFTER_MS", "1500");
        knob(attempt, "TESTAPP_EXIT_CODE", "3");
    })
    .await;
    let before = host.who_serves().await.expect("b1 serves");
    let mut watching = Watching::start(&host.engine);
    let exit = watching.exit().await;
    assert_eq!((exit.exit.exit_code, exit.exit.signal), (Some(3), None));
    assert_eq!(exit.reason(), "exited");
    let state = watching.state().await;
    assert_eq!(state.supervised.state, ServingState::Exited);
    let message = state.supervised.message.clone().unwrap_or_default();
    assert!(
        message.contains("exit code 3; restartPolicy Never does not restart it"),
        "{message}"
    );
    // The decision is on file: no restart is owed.
    let journaled = entry(&host.engine, &host);
    let supervised = journaled
        .supervised
        .expect("the lineage is kept for the report");
    assert_eq!(supervised.restart_at_ms, None);
    assert_eq!(supervised.restarts, 0);
    assert_reaped(before.pid);
    assert_down(&host);
}

#[tokio::test]
async fn a_crash_loop_backs_off_between_restarts() {
    let host = SwapHost::with_config(
        "supervise-loop",
        backing_off(Duration::from_millis(200), Duration::from_millis(400)),
    );
    // Every generation serves, then exits 1 a moment later.
    host.install_with(1, "b1", |attempt| {
        knob(attempt, "TESTAPP_EXIT_AFTER_MS", "1200");
    })
    .await;
    let mut watching = Watching::start(&host.engine);
    let states = watching.states_until_restarts(3).await;
    let seen: Vec<(ServingState, u32, u32, u64)> = states
        .iter()
        .map(|c| {
            let s = &c.supervised;
            (s.state, s.restarts, s.consecutive_exits, s.generation)
        })
        .collect();
    use ServingState::{BackOff, Exited, Running};
    assert_eq!(
        seen,
        [
            (Running, 0, 0, 1),
            (Exited, 0, 1, 1),
            (Running, 1, 1, 2),
            (BackOff, 1, 2, 2),
            (Running, 2, 2, 3),
            (BackOff, 2, 3, 3),
            (Running, 3, 3, 4),
        ],
        "what the journal held, then a restart at once, then backing off, each restart a new generation"
    );
    // The waits asked for: none, then 200 ms, then the 400 ms cap.
    let waits: Vec<i64> = states
        .iter()
        .filter(|c| c.supervised.state != Running)
        .map(|c| {
            let exit = c.last_exit.as_ref().expect("an exit");
            c.supervised.restart_at_ms.expect("a restart is owed") - exit.at_ms
        })
        .collect();
    assert_eq!(waits.len(), 3);
    assert!(waits[0] < 200, "the first restart is at once: {waits:?}");
    assert!(waits[1] >= 200 && waits[2] >= 400, "{waits:?}");
    drop(watching);
    host.tear_down().await;
}

#[tokio::test]
async fn a_worker_that_finished_is_not_restarted() {
    // A one-shot that exits 0 inside its window: done, nothing to supervise.
    let host = SwapHost::new("supervise-oneshot");
    let build = host.build("job");
    let mut attempt = host.attempt(1, &build, "job");
    attempt.spec.kind = InstanceKind::Worker;
    attempt.spec.settle.seconds = 10;
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "300");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "0");
    let watching = Watching::start(&host.engine);
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(result.clean_exit);
    assert_eq!(
        entry(&host.engine, &host).supervised,
        None,
        "nothing is restarted"
    );
    assert_down(&host);
    drop(watching);

    // A worker that outlived its window and then exits 0: OnFailure (the
    // worker default) leaves it down, its job done.
    let host = SwapHost::new("supervise-worker");
    host.install_with(1, "b1", |attempt| {
        attempt.spec.kind = InstanceKind::Worker;
        knob(attempt, "TESTAPP_EXIT_AFTER_MS", "2500");
        knob(attempt, "TESTAPP_EXIT_CODE", "0");
    })
    .await;
    let mut watching = Watching::start(&host.engine);
    watching.exit().await;
    let state = watching.state().await;
    assert_eq!(state.supervised.state, ServingState::Exited);
    assert_eq!(state.supervised.restart_at_ms, None);
    let message = state.supervised.message.unwrap_or_default();
    assert!(
        message.contains("restartPolicy OnFailure does not restart it"),
        "{message}"
    );
    assert_down(&host);
}

#[tokio::test]
async fn an_instance_that_died_while_the_agent_was_stopped_is_restarted_by_the_next_agent() {
    let host = SwapHost::new("supervise-away");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");
    // The agent is gone (no supervisor runs) when the instance dies: its
    // cgroup and socket stay behind.
    node_agent::cgroup::Cgroup::at(host.instance_cgroup().join("gen-1"), None)
        .kill(Duration::from_secs(10))
        .await
        .expect("kill generation 1");
    swap_host::eventually("b1 to be dead", || !swap_host::alive(before.pid)).await;

    let next = host.next_agent(EngineConfig::default());
    let report = next.recover().await;
    assert!(report.is_clean(), "{:?}", report.errors);
    let mut watching = Watching::start(&next);
    let states = watching.states_until_restarts(1).await;
    assert_eq!(
        states.first().map(|c| c.supervised.state),
        Some(ServingState::Running),
        "the next agent first says what the journal held"
    );
    let after = swap_host::ask(&next.layout().current_socket(&host.instance))
        .await
        .expect("the restart answers");
    assert_eq!((after.build.as_str(), after.generation), ("b1", 2));
    drop(watching);
    next.stop_instance(&host.instance, &Default::default())
        .await
        .expect("stop");
    host.assert_only(None);
}

#[tokio::test]
async fn a_release_over_an_incumbent_that_already_exited_says_so() {
    for (mode, verb) in [
        (genswap_crds::Mode::Overlap, "retired"),
        (genswap_crds::Mode::Hold, "stopped"),
    ] {
        let host = SwapHost::new(&format!("supervise-gone-{verb}"));
        host.install(1, "b1").await;
        let serving = host.who_serves().await.expect("b1 serves");
        sigkill(serving.pid);
        // No supervisor runs here: the engine still holds generation 1
        // when the release comes, as when the exit and the attempt race.
        swap_host::eventually("b1 to be dead", || !swap_host::alive(serving.pid)).await;
        let b2 = host.build("b2");
        let mut attempt = host.attempt(2, &b2, "b2");
        attempt.spec.mode = mode;
        let result = host.swap(&attempt).await;
        assert_eq!(result.outcome, Outcome::Done, "{result:?}");
        assert!(
            result.reason.contains(&format!(
                "generation 1 had already exited (signal 9 (SIGKILL)) before it was {verb}"
            )),
            "{mode:?}: {}",
            result.reason
        );
        host.assert_only(Some(2));
        host.tear_down().await;
    }
}

#[tokio::test]
async fn a_generation_retired_by_a_swap_is_not_reported_as_an_exit() {
    let (host, attempt) = SwapHost::serving_b1_releasing_b2("supervise-retire").await;
    let mut watching = Watching::start(&host.engine);
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    // The retired generation's watch fires; the supervisor sees that it is
    // not what serves and reports nothing. Then b2 is killed: that exit,
    // and only it, is reported.
    let serving = host.who_serves().await.expect("b2 serves");
    sigkill(serving.pid);
    let exit = watching.exit().await;
    assert_eq!((exit.exit.generation, exit.exit.build.as_str()), (2, "b2"));
    let state = watching.states_until_restarts(1).await;
    assert_eq!(
        state.last().map(|c| c.supervised.attempt.sched_rev),
        Some(attempt.spec.sched_rev),
        "the restart belongs to b2's attempt"
    );
    drop(watching);
    host.tear_down().await;
}

#[tokio::test]
async fn stopping_an_instance_that_backs_off_ends_its_restarts() {
    let host = SwapHost::with_config(
        "supervise-stop",
        backing_off(Duration::from_secs(600), Duration::from_secs(600)),
    );
    host.install_with(1, "b1", |attempt| {
        knob(attempt, "TESTAPP_EXIT_AFTER_MS", "1200");
    })
    .await;
    let mut watching = Watching::start(&host.engine);
    // The first exit is restarted at once; the restart's exit waits.
    loop {
        let state = watching.state().await;
        if state.supervised.state == ServingState::BackOff {
            break;
        }
    }
    // Its InstanceGeneration is deleted while nothing runs.
    let drained = host
        .engine
        .stop_instance(&host.instance, &Default::default())
        .await
        .expect("stop");
    assert_eq!(drained, None, "nothing was running");
    let journaled = entry(&host.engine, &host);
    assert_eq!(journaled.supervised, None, "no restart is owed any more");
    assert_eq!(journaled.serving, None);
    assert_down(&host);
}
