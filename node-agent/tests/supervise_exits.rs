//! Supervision between attempts, its first part (SPEC 5.10): a serving
//! generation that exits on its own or is killed is noticed at once (a
//! pidfd, no polling), reaped, cleaned up and journaled. Real testapp
//! processes on real cgroup v2.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::path::Path;
use std::time::Duration;

use genswap_crds::Outcome;
use node_agent::engine::GenerationExit;
use swap_host::{SwapHost, knob};
use tokio::sync::mpsc;

const DEADLINE: Duration = Duration::from_secs(30);

/// Kills `pid` (a serving generation's main process) with SIGKILL.
fn sigkill(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the serving generation");
}

/// Runs the engine's supervisor until it handled one exit.
async fn next_exit(host: &SwapHost) -> GenerationExit {
    let (sender, mut receiver) = mpsc::unbounded_channel();
    let supervise = host.engine.supervise(move |exit| {
        let _ = sender.send(exit);
    });
    tokio::time::timeout(DEADLINE, async {
        tokio::select! {
            () = supervise => panic!("the supervisor ended"),
            exit = receiver.recv() => exit.expect("an exit"),
        }
    })
    .await
    .expect("the exit was noticed in time")
}

/// Everything of the exited generation is gone, nothing is a zombie, and
/// the journal says nothing serves and how it ended.
fn assert_gone(host: &SwapHost, pid: u32, exit: &GenerationExit) {
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "pid {pid} was reaped, not left a zombie of the agent"
    );
    host.assert_only(None);
    assert!(
        std::fs::symlink_metadata(host.current_sock()).is_err(),
        "current.sock no longer names a dead socket"
    );
    assert_eq!(host.engine.serving(&host.instance), None);
    let entry = host
        .engine
        .journal()
        .load_entry(&host.instance)
        .expect("journal readable")
        .expect("an entry");
    assert_eq!(entry.serving, None, "the journal says nothing serves");
    assert_eq!(entry.last_exit.as_ref(), Some(&exit.exit));
}

#[tokio::test]
async fn a_killed_serving_generation_is_noticed_reaped_and_cleaned_up() {
    let host = SwapHost::new("supervise-kill");
    host.install(1, "b1").await;
    let serving = host.who_serves().await.expect("b1 serves");

    sigkill(serving.pid);
    let exit = next_exit(&host).await;

    assert_eq!(exit.instance, host.instance);
    assert_eq!((exit.exit.generation, exit.exit.build.as_str()), (1, "b1"));
    assert_eq!((exit.exit.exit_code, exit.exit.signal), (None, Some(9)));
    assert!(!exit.exit.oom_killed, "no memory controller here, no OOM");
    assert_eq!(exit.reason(), "signaled");
    assert_gone(&host, serving.pid, &exit);

    // The next attempt finds nothing serving and installs.
    let b2 = host.build("b2");
    let result = host.swap(&host.attempt(2, &b2, "b2")).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let after = host.who_serves().await.expect("b2 serves");
    assert_eq!((after.build.as_str(), after.generation), ("b2", 2));
    host.tear_down().await;
}

#[tokio::test]
async fn a_generation_exiting_by_itself_is_journaled_with_its_exit_code() {
    let host = SwapHost::new("supervise-exit");
    host.install_with(1, "b1", |attempt| {
        knob(attempt, "TESTAPP_EXIT_AFTER_MS", "1500");
        knob(attempt, "TESTAPP_EXIT_CODE", "3");
    })
    .await;
    let serving = host.who_serves().await.expect("b1 serves");
    let exit = next_exit(&host).await;
    assert_eq!((exit.exit.exit_code, exit.exit.signal), (Some(3), None));
    assert_eq!(exit.reason(), "exited");
    assert_eq!(exit.describe(), "exit code 3");
    assert_gone(&host, serving.pid, &exit);
}

#[tokio::test]
async fn a_generation_retired_by_a_swap_is_not_reported_as_an_exit() {
    let (host, attempt) = SwapHost::serving_b1_releasing_b2("supervise-retire").await;
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    // The retired generation's watch fires; the supervisor sees that it is
    // not what serves and reports nothing. Then b2 is killed: that exit,
    // and only it, is reported.
    let serving = host.who_serves().await.expect("b2 serves");
    sigkill(serving.pid);
    let exit = next_exit(&host).await;
    assert_eq!((exit.exit.generation, exit.exit.build.as_str()), (2, "b2"));
    assert_gone(&host, serving.pid, &exit);
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
                "generation 1 had already exited (signal 9) before it was {verb}"
            )),
            "{mode:?}: {}",
            result.reason
        );
        host.assert_only(Some(2));
        host.tear_down().await;
    }
}
