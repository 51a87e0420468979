//! Liveness between attempts (SPEC 5.10): the serving generation is probed
//! every period; `failureThreshold` failures in a row, and not fewer, stop
//! it with proof, and `restartPolicy` follows with a fresh generation. A
//! hung generation (SIGSTOP, as a deadlock looks from outside) is found by
//! an `httpGet` that gets no answer. Real testapp processes on real cgroup
//! v2, a real supervisor.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/supervisor_watch.rs"]
mod supervisor_watch;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use genswap_crds::{ExecProbe, HttpGetProbe, LivenessSpec};
use node_agent::engine::{Attempt, GenerationExit};
use supervisor_watch::{DEADLINE, Watching};
use swap_host::SwapHost;

fn liveness(probe: impl FnOnce(&mut LivenessSpec)) -> LivenessSpec {
    let mut spec = LivenessSpec {
        http_get: None,
        tcp_socket: None,
        grpc: None,
        exec: None,
        watchdog: false,
        initial_delay_seconds: 0,
        period_seconds: 1,
        timeout_seconds: 1,
        failure_threshold: 3,
    };
    probe(&mut spec);
    spec
}

/// A directory the `nobody` instance and its probes may write.
/// SIGSTOPs `pid`: hung, as a deadlock looks from outside.
fn hang(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("SIGSTOP the serving generation");
}

/// Why the liveness probe stopped the generation that `exit` reports.
fn liveness_failure(exit: &GenerationExit) -> String {
    exit.exit
        .liveness_failed
        .clone()
        .expect("a liveness failure")
}

fn shared_dir(host: &SwapHost) -> PathBuf {
    let dir = host.staging.with_file_name("probe");
    std::fs::create_dir_all(&dir).expect("probe dir");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_failure_threshold_failures_in_a_row_stop_and_restart_the_generation() {
    let host = SwapHost::new("liveness-exec");
    let dir = shared_dir(&host);
    let tries = dir.join("tries");
    let sick = dir.join("sick");
    let script = format!(
        r#"echo "$GENSWAP_GENERATION" >> {tries}; test ! -e {sick}"#,
        tries = tries.display(),
        sick = sick.display()
    );
    let tune = |attempt: &mut Attempt| {
        attempt.spec.liveness = Some(liveness(|l| {
            l.exec = Some(ExecProbe {
                command: vec!["sh".into(), "-c".into(), script.clone()],
            });
        }));
        // The probe runs in the generation's sandbox.
        swap_host::writable(attempt, &dir);
    };
    host.install_with(1, "b1", tune).await;
    let before = host.who_serves().await.expect("b1 serves");
    let mut watching = Watching::start(&host.engine);
    // Healthy tries do nothing: two pass before it turns sick.
    cgroup_guard::eventually(DEADLINE, "two healthy liveness tries", || {
        lines(&tries).len() >= 2
    })
    .await;
    assert_eq!(host.who_serves().await.map(|i| i.pid), Some(before.pid));

    // The marker goes in the file the probe appends to, so what follows it
    // is the tries that saw the generation sick.
    std::fs::write(&sick, "").expect("make it sick");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&tries)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"sick\n"))
        .expect("mark the file");
    let exit = watching.exit().await;
    assert_eq!(exit.exit.generation, 1);
    assert_eq!(exit.reason(), "liveness_failed");
    let failure = liveness_failure(&exit);
    assert!(failure.contains("failed 3 times in a row"), "{failure}");
    assert_eq!(exit.exit.signal, Some(15), "stopped by its stop signal");
    let after_mark: Vec<String> = lines(&tries)
        .into_iter()
        .skip_while(|line| line != "sick")
        .skip(1)
        .collect();
    let of_generation_1 = after_mark.iter().filter(|line| *line == "1").count();
    assert_eq!(
        of_generation_1, 3,
        "exactly failureThreshold tries: {after_mark:?}"
    );

    // Restarted at once (the first exit in a row), as generation 2.
    std::fs::remove_file(&sick).expect("make it well");
    watching.restarted_as(2).await;
    let now = host.who_serves().await.expect("the restart serves");
    assert_eq!(now.generation, 2);
    assert!(!Path::new(&format!("/proc/{}", before.pid)).exists());
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_generation_is_found_by_its_liveness_probe_and_replaced() {
    let host = SwapHost::new("liveness-hung");
    let tune = |attempt: &mut Attempt| {
        attempt.spec.stop.timeout_seconds = 1;
        attempt.spec.liveness = Some(liveness(|l| {
            l.http_get = Some(HttpGetProbe::default());
            l.failure_threshold = 2;
        }));
    };
    host.install_with(1, "b1", tune).await;
    let before = host.who_serves().await.expect("b1 serves");
    let mut watching = Watching::start(&host.engine);
    hang(before.pid);

    let exit = watching.exit().await;
    let failure = liveness_failure(&exit);
    assert!(failure.contains("no answer within 1s"), "{failure}");
    assert_eq!(
        exit.exit.signal,
        Some(9),
        "a stopped process ignores SIGTERM: killed after the stop timeout"
    );
    assert!(
        exit.describe().contains("after its liveness probe"),
        "{}",
        exit.describe()
    );
    watching.restarted_as(2).await;
    let now = host.who_serves().await.expect("the restart serves");
    assert_eq!((now.build.as_str(), now.generation), ("b1", 2));
    host.assert_only(Some(2));
    host.tear_down().await;
}

/// A notify generation of the test app that pings `WATCHDOG=1`, judged by
/// the watchdog every second, `failure_threshold` missed periods stopping
/// it.
fn watchdog_of(failure_threshold: i32) -> impl FnOnce(&mut Attempt) {
    move |attempt: &mut Attempt| {
        swap_host::knob(attempt, testapp::knob::NOTIFY, "ready");
        swap_host::knob(attempt, testapp::knob::WATCHDOG, "1");
        attempt.spec.health = genswap_crds::HealthSpec {
            notify: Some(genswap_crds::NotifyProbe {}),
            timeout_seconds: 20,
            ..genswap_crds::HealthSpec::default()
        };
        attempt.spec.stop.timeout_seconds = 1;
        attempt.spec.liveness = Some(liveness(|l| {
            l.watchdog = true;
            l.failure_threshold = failure_threshold;
        }));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generation_whose_watchdog_pings_stop_is_restarted_and_one_that_pings_is_not() {
    let host = SwapHost::new("liveness-watchdog");
    host.install_with(1, "b1", watchdog_of(2)).await;
    let before = host.who_serves().await.expect("b1 serves");
    let mut watching = Watching::start(&host.engine);
    // Pinging every half period, it outlives many times failureThreshold
    // periods.
    let quiet = tokio::time::timeout(std::time::Duration::from_secs(5), watching.exit()).await;
    assert!(
        quiet.is_err(),
        "a pinging generation was stopped: {quiet:?}"
    );
    assert_eq!(host.who_serves().await.map(|i| i.pid), Some(before.pid));

    hang(before.pid);
    let exit = watching.exit().await;
    assert_eq!(exit.exit.generation, 1);
    let failure = liveness_failure(&exit);
    assert!(failure.contains("WATCHDOG=1"), "{failure}");
    assert!(failure.contains("failed 2 times in a row"), "{failure}");
    watching.restarted_as(2).await;
    let now = host.who_serves().await.expect("the restart serves");
    assert_eq!((now.build.as_str(), now.generation), ("b1", 2));
    host.assert_only(Some(2));
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_agent_still_hears_the_watchdog_of_the_generation_it_adopts() {
    let host = SwapHost::new("liveness-watchdog-adopt");
    host.install_with(1, "b1", watchdog_of(2)).await;
    let before = host.who_serves().await.expect("b1 serves");

    // The next agent binds the generation's NOTIFY_SOCKET path again: the
    // pings it sends from now on reach it.
    let next = host.next_agent(node_agent::engine::EngineConfig::default());
    let report = next.recover().await;
    assert!(report.is_clean(), "{:?}", report.errors);
    let mut watching = Watching::start(&next);
    let quiet = tokio::time::timeout(std::time::Duration::from_secs(4), watching.exit()).await;
    assert!(
        quiet.is_err(),
        "a pinging generation was stopped: {quiet:?}"
    );

    hang(before.pid);
    let exit = watching.exit().await;
    let failure = liveness_failure(&exit);
    assert!(failure.contains("WATCHDOG=1"), "{failure}");
    watching.restarted_as(2).await;
    drop(watching);
    next.stop_instance(&host.instance, &Default::default())
        .await
        .expect("stop");
    host.assert_only(None);
}
