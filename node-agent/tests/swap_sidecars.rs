//! Sidecars (SPEC 5.13) with real processes on real cgroup v2: a testapp
//! in its sidecar mode asks its generation what it is over
//! `GENSWAP_TARGET_SOCKET` every 20 ms and writes each new answer to a
//! report file, so the file shows which generation each sidecar reached.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/sidecar_report.rs"]
mod sidecar_report;
#[path = "support/supervisor_watch.rs"]
mod supervisor_watch;
#[path = "support/swap_host.rs"]
mod swap_host;
#[path = "support/tcp_client.rs"]
mod tcp_client;

use std::path::{Path, PathBuf};
use std::time::Duration;

use genswap_crds::{
    Artifact, BuildSpec, ListenerSpec, Mode, Outcome, ProcessSpec, RestartPolicy, SidecarSpec,
    SidecarState, SidecarStatus,
};
use node_agent::engine::{Attempt, EngineConfig, RestartBackoff};
use sidecar_report::{
    args, assert_each_saw_only_its_own, field, lines, pid_of, report_in, saw_own, starts,
};
use swap_host::{SwapHost, alive, eventually};
use tcp_client::free_port;

use supervisor_watch::Watching;

/// A report file a `nobody` sidecar may create.
fn report_file(host: &SwapHost, name: &str) -> PathBuf {
    report_in(&host.staging.with_file_name("sidecars"), name)
}

/// A sidecar `name` running the instance's build in its sidecar mode.
fn watcher(name: &str, report: &Path, extra: &[&str]) -> SidecarSpec {
    SidecarSpec {
        name: name.into(),
        build: None,
        process: ProcessSpec {
            args: args(report, extra),
            ..ProcessSpec::default()
        },
        restart_policy: None,
        listeners: Vec::new(),
    }
}

/// The generation's sidecar cgroup `name`.
fn sidecar_cgroup(host: &SwapHost, n: u64, name: &str) -> PathBuf {
    host.instance_cgroup()
        .join(format!("gen-{n}"))
        .join(format!("sidecar-{name}"))
}

fn fast_backoff() -> EngineConfig {
    EngineConfig {
        restart_backoff: RestartBackoff {
            initial: Duration::from_millis(400),
            max: Duration::from_secs(2),
            ..RestartBackoff::default()
        },
        ..EngineConfig::default()
    }
}

/// `sidecars` for the attempt, which may write the dirs of their reports
/// (they run in the generation's sandbox).
fn with_sidecars(attempt: &mut Attempt, sidecars: Vec<SidecarSpec>) {
    for sidecar in &sidecars {
        for arg in &sidecar.process.args {
            if let Some(dir) = arg
                .strip_prefix("--sidecar-report=")
                .and_then(|report| Path::new(report).parent())
            {
                swap_host::writable(attempt, dir);
            }
        }
    }
    attempt.spec.sidecars = sidecars;
}

/// After a swap to generation `n`: its sidecar runs, reached it, and is
/// the only sidecar process; the sidecar of `retired` is proven gone.
async fn assert_follows(host: &SwapHost, report: &Path, n: u64, retired: Option<u64>) {
    eventually(&format!("generation {n}'s sidecar to reach it"), || {
        saw_own(report, n)
    })
    .await;
    let serving = host.who_serves().await.expect("a generation serves");
    assert_eq!(serving.generation, n);
    let start = starts(report, n);
    assert_eq!(
        start.len(),
        1,
        "one start of generation {n}'s sidecar: {start:?}"
    );
    assert_eq!(
        field(&start[0], "target_pid"),
        Some(serving.pid.to_string().as_str()),
        "GENSWAP_TARGET_PID is the generation's main process"
    );
    assert_eq!(
        field(&start[0], "socket"),
        Some("unset"),
        "a sidecar gets no GENSWAP_SOCKET of its own"
    );
    let pid = pid_of(&start[0]);
    let procs = std::fs::read_to_string(sidecar_cgroup(host, n, "watcher").join("cgroup.procs"))
        .expect("the sidecar's cgroup");
    assert_eq!(
        procs.trim(),
        pid.to_string(),
        "the sidecar runs in its cgroup below generation {n}"
    );
    if let Some(old) = retired {
        for line in starts(report, old) {
            let pid = pid_of(&line);
            assert!(
                !alive(pid),
                "generation {old}'s sidecar {pid} stopped with it"
            );
        }
        assert!(
            !host.instance_cgroup().join(format!("gen-{old}")).exists(),
            "generation {old}'s cgroup, its sidecar's with it, is gone"
        );
    }
    host.assert_only(Some(n));
    assert_each_saw_only_its_own(report);
    let posted = host.engine.sidecars(&host.instance);
    assert_eq!(posted.len(), 1, "{posted:?}");
    assert_eq!(
        (posted[0].state, posted[0].generation),
        (SidecarState::Running, i64::try_from(n).expect("n"))
    );
}

#[tokio::test]
async fn a_sidecar_reaches_only_its_generation_across_an_overlap_a_hold_and_a_restart() {
    let host = SwapHost::with_config("sidecar-follow", fast_backoff());
    let report = report_file(&host, "watcher");
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    with_sidecars(&mut install, vec![watcher("watcher", &report, &[])]);
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    assert_follows(&host, &report, 1, None).await;

    // Overlap: generation 2's sidecar starts only after its switch, and
    // generation 1's stops with generation 1.
    let b2 = host.build("b2");
    let mut overlap = host.attempt(2, &b2, "b2");
    with_sidecars(&mut overlap, vec![watcher("watcher", &report, &[])]);
    let result = host.swap(&overlap).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_follows(&host, &report, 2, Some(1)).await;

    // Hold.
    let b3 = host.build("b3");
    let mut hold = host.attempt(3, &b3, "b3");
    hold.spec.mode = Mode::Hold;
    with_sidecars(&mut hold, vec![watcher("watcher", &report, &[])]);
    let result = host.swap(&hold).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert_follows(&host, &report, 3, Some(2)).await;

    // A supervised restart after the generation is killed.
    let mut watching = Watching::start(&host.engine);
    let before = host.who_serves().await.expect("b3 serves");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(before.pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL generation 3");
    watching.states_until_restarts(1).await;
    assert_follows(&host, &report, 4, Some(3)).await;

    host.tear_down().await;
    for line in lines(&report).iter().filter(|l| l.starts_with("start ")) {
        assert!(
            !alive(pid_of(line)),
            "no sidecar outlives the instance: {line}"
        );
    }
}

#[tokio::test]
async fn a_crash_looping_sidecar_backs_off_and_never_touches_its_generation() {
    let host = SwapHost::with_config("sidecar-loop", fast_backoff());
    let report = report_file(&host, "loop");
    let once = report_file(&host, "once");
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    let mut finished = watcher("finished", &once, &["--exit-after-ms=10", "--exit-code=0"]);
    finished.restart_policy = Some(RestartPolicy::OnFailure);
    // Its own build, whose digest does not match: it is never started, and
    // the swap does not care.
    let mut unstaged = watcher("unstaged", &once, &[]);
    unstaged.build = Some(BuildSpec {
        signed_by: None,
        signature: None,
        id: "w0".into(),
        artifact: Artifact {
            path: Some(b1.path.display().to_string()),
            url: None,
            image: None,
            unpack: None,
        },
        sha256: "0".repeat(64),
        entrypoint: None,
    });
    with_sidecars(
        &mut install,
        vec![
            watcher("crasher", &report, &["--exit-after-ms=30", "--exit-code=3"]),
            finished,
            unstaged,
        ],
    );
    let result = host.swap(&install).await;
    assert_eq!(
        result.outcome,
        Outcome::Done,
        "a sidecar never fails a swap: {result:?}"
    );
    let serving = host.who_serves().await.expect("b1 serves");

    let find = |name: &str| -> Option<SidecarStatus> {
        host.engine
            .sidecars(&host.instance)
            .into_iter()
            .find(|s| s.name == name)
    };
    eventually("the crasher to back off after 3 restarts", || {
        find("crasher").is_some_and(|s| s.restarts >= 3 && s.state == SidecarState::BackOff)
    })
    .await;
    let crasher = find("crasher").expect("posted");
    let exit = crasher
        .last_exit
        .as_ref()
        .unwrap_or_else(|| panic!("its last exit: {crasher:?}"));
    assert_eq!((exit.exit_code, exit.signal), (Some(3), None));
    assert!(crasher.restart_at.is_some(), "{crasher:?}");
    assert!(
        crasher
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("starting it again in"),
        "{crasher:?}"
    );
    // With waits of 0, 0.4, 0.8 and 1.6 s, 2 s hold at most 4 more starts;
    // without a backoff a 30 ms crash would start about 30 times.
    let restarts = crasher.restarts;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = find("crasher").expect("posted").restarts;
    assert!(
        later - restarts <= 4,
        "{restarts} then {later} restarts in 2 s: no backoff"
    );

    eventually("the finished sidecar to be left down", || {
        find("finished").is_some_and(|s| s.state == SidecarState::Exited)
    })
    .await;
    let finished = find("finished").expect("posted");
    assert_eq!(finished.restarts, 0, "OnFailure does not restart an exit 0");
    let unstaged = find("unstaged").expect("posted");
    assert!(
        unstaged
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("could not be staged"),
        "{unstaged:?}"
    );
    assert_ne!(unstaged.state, SidecarState::Running);

    assert_eq!(
        host.who_serves().await.as_ref(),
        Some(&serving),
        "the generation serves on, untouched"
    );
    host.assert_only(Some(1));
    host.tear_down().await;
}

#[tokio::test]
async fn a_sidecar_gets_the_listeners_it_names_and_logs_beside_its_generation() {
    let host = SwapHost::new("sidecar-logs");
    let report = report_file(&host, "watcher");
    let b1 = host.build("b1");
    let mut install = host.attempt(1, &b1, "b1");
    install.spec.listeners = vec![ListenerSpec {
        name: "web".into(),
        tcp: Some(format!("127.0.0.1:{}", free_port())),
        udp: None,
        unix: None,
        backlog: 64,
    }];
    let mut named = watcher("watcher", &report, &[]);
    named.listeners = vec!["web".into()];
    with_sidecars(&mut install, vec![named]);
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    eventually("the sidecar to start", || saw_own(&report, 1)).await;
    let start = starts(&report, 1);
    assert_eq!(field(&start[0], "listen_fds"), Some("1"), "{start:?}");

    let log = host.log_dir().join("default_app").join("1-watcher.log");
    eventually("the sidecar's log file to hold its first answer", || {
        std::fs::read_to_string(&log).is_ok_and(|text| text.contains("saw generation=1"))
    })
    .await;
    let printed = std::process::Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .args(["logs", "default/app", "--sidecar", "watcher", "--log-dir"])
        .arg(host.log_dir())
        .output()
        .expect("node-agent logs");
    assert!(printed.status.success(), "{printed:?}");
    let text = String::from_utf8_lossy(&printed.stdout);
    assert!(text.starts_with("start generation=1 "), "{text}");
    assert!(text.contains("saw generation=1 "), "{text}");
    let own = std::process::Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .args(["logs", "default/app", "--log-dir"])
        .arg(host.log_dir())
        .output()
        .expect("node-agent logs");
    assert!(
        !String::from_utf8_lossy(&own.stdout).contains("saw generation"),
        "the generation's own log holds none of its sidecar's lines"
    );
    host.tear_down().await;
}
