//! Builds that misbehave, as the successor of a serving incumbent (and as a
//! first install): they crash at once, exit 0 at once although they are
//! servers, never bind their socket, hang on every request, ignore SIGTERM
//! while failing, fork children while failing. Each ends `failed` (`down`
//! in a hold, once the incumbent was stopped) with a reason that says what
//! the build did, and leaves nothing of itself behind: no process, no
//! cgroup, no socket. `swap_overlap.rs` and `swap_hold.rs` have the 500
//! answers, an incumbent that ignores SIGTERM and an incumbent whose
//! forked children must die with it.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{Mode, Outcome};
use node_agent::classify::StepOutcome;
use node_agent::engine::{Attempt, Step, SwapResult};
use swap_host::{SwapHost, knob};

/// Runs `attempt` against the serving b1 and checks the build failure:
/// `failed`, executed, the health step failed, the reason has every phrase
/// of `says`, b1 still answers through `current.sock` and is all that is
/// left.
async fn assert_build_failed(host: &SwapHost, attempt: &Attempt, says: &[&str]) -> SwapResult {
    let before = host.who_serves().await.expect("b1 serves");
    let result = host.swap(attempt).await;
    eprintln!("reason: {}", result.reason);
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(result.executed, "the build ran: {result:?}");
    assert!(!result.clean_exit, "{result:?}");
    let health = result
        .steps
        .iter()
        .find(|s| s.step == Step::Health)
        .expect("a health step");
    assert_eq!(health.result, StepOutcome::Failed, "{result:?}");
    assert!(
        !result.steps.iter().any(|s| s.step == Step::Switch),
        "nothing switched: {result:?}"
    );
    assert!(
        result.reason.starts_with("health: "),
        "the reason names the step: {}",
        result.reason
    );
    swap_host::assert_says(&result.reason, says);
    host.assert_still_serves(&before).await;
    result
}

#[tokio::test]
async fn a_build_that_crashes_at_once_fails_and_the_incumbent_serves() {
    let (host, mut attempt) = SwapHost::serving_b1_releasing_b2("build-crash").await;
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "0");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "3");
    let result = assert_build_failed(
        &host,
        &attempt,
        &[
            "generation 2 exited before it was healthy",
            "exit status: 3",
        ],
    )
    .await;
    assert!(
        result.step_duration(Step::Health) < std::time::Duration::from_secs(20),
        "an exit ends the health step without waiting for its deadline: {result:?}"
    );
    host.tear_down().await;
}

/// A server (`kind: instance`) must keep running: an exit 0 is a failure,
/// never a one-shot's success (only workers have those).
#[tokio::test]
async fn a_server_that_exits_0_at_once_fails_it_is_not_a_clean_exit() {
    let (host, mut attempt) = SwapHost::serving_b1_releasing_b2("build-exit0").await;
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "0");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "0");
    assert_build_failed(
        &host,
        &attempt,
        &[
            "generation 2 exited before it was healthy",
            "exit status: 0",
        ],
    )
    .await;
    host.tear_down().await;
}

#[tokio::test]
async fn a_server_that_exits_0_at_once_in_a_hold_is_down_and_nothing_serves() {
    let host = SwapHost::new("build-exit0-hold");
    host.install(1, "b1").await;
    let before = host.who_serves().await.expect("b1 serves");
    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.mode = Mode::Hold;
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "0");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "0");
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Down, "{result:?}");
    assert!(!result.clean_exit, "a server's exit 0 is no success");
    for words in [
        "exited before it was healthy",
        "exit status: 0",
        "nothing serves",
    ] {
        assert!(
            result.reason.contains(words),
            "{words:?}: {}",
            result.reason
        );
    }
    assert!(!swap_host::alive(before.pid), "the incumbent was stopped");
    assert_eq!(host.who_serves().await, None);
    assert!(!host.current_sock().exists(), "current.sock names nothing");
    host.assert_only(None);
}

#[tokio::test]
async fn a_first_install_that_exits_0_at_once_fails_and_leaves_nothing() {
    let host = SwapHost::new("build-exit0-install");
    let b1 = host.build("b1");
    let mut attempt = host.attempt(1, &b1, "b1");
    knob(&mut attempt, "TESTAPP_EXIT_AFTER_MS", "0");
    knob(&mut attempt, "TESTAPP_EXIT_CODE", "0");
    let result = host.swap(&attempt).await;
    assert_eq!(
        result.outcome,
        Outcome::Failed,
        "an install stopped nothing, so it is never down: {result:?}"
    );
    assert!(
        result.reason.contains("exit status: 0"),
        "{}",
        result.reason
    );
    assert_eq!(host.who_serves().await, None);
    assert!(!host.current_sock().exists());
    host.assert_only(None);
}

#[tokio::test]
async fn a_build_that_never_binds_its_socket_fails_at_the_health_deadline() {
    let (host, mut attempt) = SwapHost::serving_b1_releasing_b2("build-never-bind").await;
    attempt.spec.health.timeout_seconds = 2;
    knob(&mut attempt, "TESTAPP_NEVER_BIND", "1");
    let socket = host.run_dir.join("default.app").join("gen-2.sock");
    assert_build_failed(
        &host,
        &attempt,
        &[
            "no healthy answer on",
            &socket.display().to_string(),
            "within 2s",
            "no socket at the path (not bound)",
        ],
    )
    .await;
    host.tear_down().await;
}

#[tokio::test]
async fn a_build_that_hangs_on_every_request_fails_at_the_health_deadline() {
    let (host, mut attempt) = SwapHost::serving_b1_releasing_b2("build-hang").await;
    // The build must bind before the deadline for it to show the hang:
    // 5 s leaves room on a loaded machine.
    attempt.spec.health.timeout_seconds = 5;
    knob(&mut attempt, "TESTAPP_HANG", "1");
    assert_build_failed(&host, &attempt, &["within 5s", "no answer within"]).await;
    host.tear_down().await;
}

#[tokio::test]
async fn a_failing_build_that_ignores_sigterm_is_killed_and_leaves_nothing() {
    let (host, mut attempt) = SwapHost::serving_b1_releasing_b2("build-ignore-term").await;
    // Long enough for the build to bind and answer 500 on a loaded machine.
    attempt.spec.health.timeout_seconds = 5;
    attempt.spec.stop.timeout_seconds = 1;
    knob(&mut attempt, "TESTAPP_STATUS", "500");
    knob(&mut attempt, "TESTAPP_IGNORE_SIGTERM", "1");
    let gen2 = host.instance_cgroup().join("gen-2");
    let watcher = tokio::spawn(first_pids(gen2));
    assert_build_failed(&host, &attempt, &["answered 500"]).await;
    assert_none_survived(watcher).await;
    host.tear_down().await;
}

#[tokio::test]
async fn a_failing_build_that_forks_children_takes_them_all_down() {
    let host = SwapHost::new("build-forks");
    host.install(1, "b1").await;
    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    attempt.spec.health.timeout_seconds = 5;
    attempt.spec.stop.timeout_seconds = 1;
    knob(&mut attempt, "TESTAPP_STATUS", "500");
    knob(&mut attempt, "TESTAPP_FORK_CHILDREN", "3");
    let gen2 = host.instance_cgroup().join("gen-2");
    let watcher = tokio::spawn(family_of_four(gen2));
    assert_build_failed(&host, &attempt, &["answered 500"]).await;
    let family = watcher.await.expect("the pid watcher");
    assert_eq!(family.len(), 4, "b2 and its three children: {family:?}");
    for pid in family {
        assert!(!swap_host::alive(pid), "pid {pid} of generation 2 survived");
    }
    host.tear_down().await;
}

/// The pids in `cgroup` once it has any (polled until it does).
/// Generation 2 ran (`watcher` saw its pids) and none of them is alive.
async fn assert_none_survived(watcher: tokio::task::JoinHandle<Vec<u32>>) {
    let seen = watcher.await.expect("the pid watcher");
    assert!(!seen.is_empty(), "generation 2 ran");
    for pid in seen {
        assert!(!swap_host::alive(pid), "pid {pid} of generation 2 survived");
    }
}

async fn first_pids(cgroup: std::path::PathBuf) -> Vec<u32> {
    let mut pids = Vec::new();
    swap_host::eventually("generation 2 to run", || {
        pids = procs(&cgroup);
        !pids.is_empty()
    })
    .await;
    pids
}

/// The four pids of a testapp that forked three children.
async fn family_of_four(cgroup: std::path::PathBuf) -> Vec<u32> {
    let mut pids = Vec::new();
    swap_host::eventually("generation 2 and its three children", || {
        pids = procs(&cgroup);
        pids.len() >= 4
    })
    .await;
    pids
}

fn procs(cgroup: &std::path::Path) -> Vec<u32> {
    std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// A build that is a `#!` script with `body` after its first line.
fn script_build(host: &SwapHost, name: &str, shebang: &str, body: &str) -> testapp::Build {
    use sha2::Digest;
    use std::os::unix::fs::PermissionsExt;
    let path = host.staging.join(name);
    let text = format!("{shebang}\n{body}\n");
    std::fs::write(&path, &text).expect("write the script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    testapp::Build {
        path,
        sha256: hex::encode(sha2::Sha256::digest(text.as_bytes())),
    }
}

#[tokio::test]
async fn a_shell_script_build_serves_whether_it_execs_its_server_or_stays_its_parent() {
    for (tag, body) in [
        ("exec", "exec {server} \"$@\""),
        ("parent", "{server} \"$@\"\nexit $?"),
    ] {
        let host = SwapHost::new(&format!("build-script-{tag}"));
        let server = host.build("server");
        let script = script_build(
            &host,
            "wrapper.sh",
            "#!/bin/sh",
            &body.replace("{server}", &server.path.display().to_string()),
        );
        let mut attempt = host.attempt(1, &script, "wrapped");
        // The server it runs lies in the test's temp dir, behind the
        // instance's private /tmp.
        attempt.spec.process.writable_paths = vec![host.staging.display().to_string()];
        let result = host.swap(&attempt).await;
        assert_eq!(result.outcome, Outcome::Done, "{tag}: {result:?}");
        let serving = host.who_serves().await.expect("the wrapped server answers");
        assert_eq!((serving.build.as_str(), serving.generation), ("wrapped", 1));
        host.tear_down().await;
    }
}

#[tokio::test]
async fn a_script_whose_interpreter_is_missing_fails_naming_it_and_leaves_nothing() {
    let host = SwapHost::new("build-no-interpreter");
    let script = script_build(&host, "broken.sh", "#!/nonexistent/sh -e", "exit 0");
    let result = host.swap(&host.attempt(1, &script, "broken")).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert!(!result.executed, "nothing of it ran: {result:?}");
    swap_host::assert_says(
        &result.reason,
        &[
            "spawn: ",
            "interpreter /nonexistent/sh named on its #! line does not exist",
        ],
    );
    host.assert_only(None);
    assert!(
        !host.instance_cgroup().exists(),
        "no empty instance cgroup is left"
    );
    assert!(
        !host.run_dir.join(host.instance.to_string()).exists(),
        "no empty run dir is left"
    );
}

#[tokio::test]
async fn a_build_that_stops_itself_after_binding_fails_at_the_deadline_and_is_killed() {
    let (host, mut attempt) = SwapHost::serving_b1_releasing_b2("build-sigstop").await;
    attempt.spec.health.timeout_seconds = 3;
    attempt.spec.stop.timeout_seconds = 1;
    knob(&mut attempt, "TESTAPP_STOP_AFTER_BIND", "1");
    let gen2 = host.instance_cgroup().join("gen-2");
    let watcher = tokio::spawn(first_pids(gen2));
    assert_build_failed(&host, &attempt, &["within 3s"]).await;
    assert_none_survived(watcher).await;
    host.tear_down().await;
}
