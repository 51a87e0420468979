//! A generation's life around its exec and its stop signal (SPEC 5.5
//! steps 6 and 9): the `lifecycle.preStop` hook runs before the stop
//! signal, with `MAINPID`, inside the stop timeout; a daemon that forks is
//! run by its `process.pidFile` (systemd's `Type=forking`), swapped and
//! supervised; one that forks without it fails saying so. Real testapp
//! processes on real cgroup v2.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/supervisor_watch.rs"]
mod supervisor_watch;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use genswap_crds::{ExecProbe, LifecycleHandler, LifecycleSpec, Outcome};
use node_agent::engine::{Attempt, Step};
use supervisor_watch::Watching;
use swap_host::{SwapHost, alive, assert_says, knob};

/// A directory the `nobody` instance and its hooks may write.
fn shared_dir(host: &SwapHost) -> PathBuf {
    let dir = host.staging.with_file_name("hooks");
    std::fs::create_dir_all(&dir).expect("hook dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("open it");
    dir
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

fn pre_stop(script: &str) -> Option<LifecycleSpec> {
    Some(LifecycleSpec {
        pre_stop: Some(LifecycleHandler {
            exec: ExecProbe {
                command: vec!["sh".into(), "-c".into(), script.into()],
            },
        }),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pre_stop_hook_runs_before_the_stop_signal_and_a_hung_one_is_killed_at_the_timeout() {
    let host = SwapHost::new("prestop");
    let dir = shared_dir(&host);
    let order = dir.join("order");
    let script = format!(
        r#"kill -0 "$MAINPID" && echo "preStop $MAINPID $GENSWAP_GENERATION" >> {}"#,
        order.display()
    );
    let log_term = |attempt: &mut Attempt| {
        knob(
            attempt,
            testapp::knob::TERM_LOG,
            &order.display().to_string(),
        );
        // The instance and its hooks write there, through the sandbox.
        swap_host::writable(attempt, &dir);
    };
    host.install_with(1, "b1", |attempt| {
        log_term(attempt);
        attempt.spec.lifecycle = pre_stop(&script);
    })
    .await;
    let b1 = host.who_serves().await.expect("b1 serves");

    // b2's hook hangs: it is killed at b2's stop timeout, and the stop
    // signal still comes, after it.
    let hung = dir.join("hung");
    let b2 = host.build("b2");
    let mut attempt = host.attempt(2, &b2, "b2");
    log_term(&mut attempt);
    attempt.spec.stop.timeout_seconds = 1;
    attempt.spec.lifecycle = pre_stop(&format!("echo $$ > {}; exec sleep 600", hung.display()));
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_eq!(
        lines(&order),
        [format!("preStop {} 1", b1.pid), "SIGTERM".to_string()],
        "the hook ran against the running b1, then its stop signal came"
    );
    assert!(!alive(b1.pid));

    let b3 = host.build("b3");
    let result = host.swap(&host.attempt(3, &b3, "b3")).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let hook: u32 = std::fs::read_to_string(&hung)
        .expect("the hung hook ran")
        .trim()
        .parse()
        .expect("its pid");
    assert!(!alive(hook), "the hung hook was killed");
    assert_eq!(
        lines(&order).last().map(String::as_str),
        Some("SIGTERM"),
        "b2 got its stop signal after its hook was killed"
    );
    // 1 s for the hook, then the stop signal's grace: far below the
    // hook's 600 s.
    let retire = result.step_duration(Step::Retire);
    assert!(retire.as_secs() < 30, "{retire:?}");
    host.assert_only(Some(3));
    host.tear_down().await;
}

/// An attempt of `build` as a daemon that forks: its start exits 0 and
/// its child serves, writing `pid_file` once it does.
fn forking(host: &SwapHost, rev: i64, build: &str, pid_file: &Path, declared: bool) -> Attempt {
    let made = host.build(build);
    let mut attempt = host.attempt(rev, &made, build);
    knob(&mut attempt, testapp::knob::DAEMONIZE, "1");
    knob(
        &mut attempt,
        testapp::knob::PID_FILE,
        &pid_file.display().to_string(),
    );
    if declared {
        attempt.spec.process.pid_file = Some(pid_file.display().to_string());
    }
    if let Some(dir) = pid_file.parent() {
        swap_host::writable(&mut attempt, dir);
    }
    attempt
}

/// The session a process leads, from `/proc/<pid>/stat`.
fn session_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    // state, ppid, pgrp, session
    rest.split_whitespace().nth(3)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_with_a_pid_file_is_swapped_and_supervised() {
    let host = SwapHost::new("pidfile");
    let pid_file = shared_dir(&host).join("app.pid");
    let result = host.swap(&forking(&host, 1, "b1", &pid_file, true)).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let b1 = host.who_serves().await.expect("b1's daemon serves");
    assert_eq!(session_of(b1.pid), Some(b1.pid), "it is the forked child");

    // An overlap: b2's daemon writes the same file, which names b1's pid
    // until it does; only a pid in b2's own cgroup is taken.
    let result = host.swap(&forking(&host, 2, "b2", &pid_file, true)).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    let b2 = host.who_serves().await.expect("b2's daemon serves");
    assert_eq!((b2.build.as_str(), b2.generation), ("b2", 2));
    assert!(!alive(b1.pid), "b1's daemon retired");
    host.assert_only(Some(2));

    // Its exit is noticed though it is not the agent's child, and it is
    // restarted as generation 3.
    let mut watching = Watching::start(&host.engine);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(b2.pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill b2's daemon");
    let exit = watching.exit().await;
    assert_eq!(exit.exit.generation, 2);
    assert_eq!(exit.exit.exit_code, None, "not the agent's child: unknown");
    watching.restarted_as(3).await;
    let b3 = host.who_serves().await.expect("the restart serves");
    assert_eq!((b3.build.as_str(), b3.generation), ("b2", 3));
    assert_eq!(session_of(b3.pid), Some(b3.pid));
    host.assert_only(Some(3));
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_daemonizes_without_a_pid_file_fails_saying_how_to_run_it() {
    let host = SwapHost::new("daemonized");
    let pid_file = shared_dir(&host).join("app.pid");
    let result = host.swap(&forking(&host, 1, "b1", &pid_file, false)).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert_says(
        &result.reason,
        &[
            "generation 1 exited 0 before it was healthy while its cgroup still holds a process",
            "it daemonized",
            "run it in the foreground",
            "process.pidFile",
        ],
    );
    host.assert_only(None);
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pid_file_that_names_a_process_outside_the_generation_is_not_taken() {
    let host = SwapHost::new("pidfile-foreign");
    let dir = shared_dir(&host);
    // The daemon writes a file of its own; the declared one names pid 1.
    let declared = dir.join("stale.pid");
    std::fs::write(&declared, "1\n").expect("a stale pid file");
    let mut attempt = forking(&host, 1, "b1", &dir.join("app.pid"), false);
    attempt.spec.process.pid_file = Some(declared.display().to_string());
    attempt.spec.health.timeout_seconds = 2;
    let result = host.swap(&attempt).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    assert_says(
        &result.reason,
        &[
            "process.pidFile",
            "names pid 1, which is not in the generation's cgroup",
        ],
    );
    host.assert_only(None);
    host.tear_down().await;
}
