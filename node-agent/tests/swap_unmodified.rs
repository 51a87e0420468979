//! Swaps of programs that know nothing of genswap (SPEC 5.12): the test app
//! never binds `GENSWAP_SOCKET`, serves only the listener the agent holds,
//! and is judged by an `httpGet` through that listener (in a hold), by
//! systemd's notify protocol (in an overlap) or by an exec command. A client
//! sends requests to the listener throughout. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/swap_host.rs"]
mod swap_host;
#[path = "support/tcp_client.rs"]
mod tcp_client;

use genswap_crds::{ExecProbe, HealthSpec, HttpGetProbe, Mode, NotifyProbe, Outcome};
use node_agent::engine::Attempt;
use swap_host::{SwapHost, knob};
use tcp_client::{Load, free_port, get, listener};

/// An attempt of `build` for a program that binds nothing itself and
/// serves the `web` listener on `port`.
fn unmodified(host: &SwapHost, rev: i64, build: &str, port: u16, health: HealthSpec) -> Attempt {
    let made = host.build(build);
    let mut attempt = host.attempt(rev, &made, build);
    attempt.spec.listeners = vec![listener(port)];
    attempt.spec.health = health;
    knob(&mut attempt, testapp::knob::NEVER_BIND, "1");
    attempt
}

fn through_listener() -> HealthSpec {
    HealthSpec {
        http_get: Some(HttpGetProbe {
            path: "/healthz".into(),
            port: None,
            listener: Some("web".into()),
        }),
        timeout_seconds: 20,
        ..HealthSpec::default()
    }
}

fn notify() -> HealthSpec {
    HealthSpec {
        notify: Some(NotifyProbe {}),
        timeout_seconds: 20,
        ..HealthSpec::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_judged_through_the_listener_drops_nothing() {
    let host = SwapHost::new("unmod-hold");
    let port = free_port();
    let mut install = unmodified(&host, 1, "b1", port, through_listener());
    install.spec.mode = Mode::Hold;
    let result = host.swap(&install).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    assert!(get(port).expect("b1 answers").contains("build=b1"));
    assert!(
        !host
            .engine
            .layout()
            .generation_socket(&host.instance, 1)
            .exists(),
        "it never bound its own socket"
    );

    let load = Load::start(port);
    let mut hold = unmodified(&host, 2, "b2", port, through_listener());
    hold.spec.mode = Mode::Hold;
    let result = host.swap(&hold).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    load.finish_with_none_failed();
    assert!(get(port).expect("b2 answers").contains("build=b2"));
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlap_judged_by_ready_1_drops_nothing_and_a_silent_successor_fails() {
    let host = SwapHost::new("unmod-notify");
    let port = free_port();
    let mut install = unmodified(&host, 1, "b1", port, notify());
    knob(&mut install, testapp::knob::NOTIFY, "ready");
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    let notify_socket = |n| {
        host.engine
            .layout()
            .instance_dir(&host.instance)
            .join(node_agent::disk_name::notify_socket_name(n))
    };
    assert!(
        notify_socket(1).exists(),
        "the serving generation keeps its NOTIFY_SOCKET"
    );

    let load = Load::start(port);
    let mut overlap = unmodified(&host, 2, "b2", port, notify());
    knob(&mut overlap, testapp::knob::NOTIFY, "ready");
    let result = host.swap(&overlap).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");
    load.finish_with_none_failed();
    assert!(get(port).expect("b2 answers").contains("build=b2"));
    assert!(
        !notify_socket(1).exists(),
        "a retired generation's socket goes with it"
    );

    // Serves the listener at once, but never says READY=1: not switched to.
    let mut silent = unmodified(&host, 3, "b3", port, notify());
    silent.spec.health.timeout_seconds = 2;
    knob(&mut silent, testapp::knob::NOTIFY, "never");
    let result = host.swap(&silent).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    swap_host::assert_says(
        &result.reason,
        &[
            "gen-3.notify (READY=1)",
            "no READY=1 yet; it says STATUS=starting",
        ],
    );
    assert!(get(port).expect("b2 still answers").contains("build=b2"));
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_probe_judges_the_successor_and_its_failure_is_the_reason() {
    let host = SwapHost::new("unmod-exec");
    let port = free_port();
    let exec = |script: &str| HealthSpec {
        exec: Some(ExecProbe {
            command: vec!["sh".into(), "-c".into(), script.into()],
        }),
        timeout_seconds: 3,
        ..HealthSpec::default()
    };
    // Healthy once this generation's own main process answers: its pid is
    // in the environment the probe shares with it.
    let install = unmodified(
        &host,
        1,
        "b1",
        port,
        exec("test \"$GENSWAP_GENERATION\" = 1"),
    );
    let result = host.swap(&install).await;
    assert_eq!(result.outcome, Outcome::Done, "{result:?}");

    let failing = unmodified(&host, 2, "b2", port, exec("echo not warmed up; exit 1"));
    let result = host.swap(&failing).await;
    assert_eq!(result.outcome, Outcome::Failed, "{result:?}");
    swap_host::assert_says(&result.reason, &["exit code 1", "not warmed up"]);
    assert!(get(port).expect("b1 still answers").contains("build=b1"));
    host.tear_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_through_a_listener_the_attempt_lacks_is_refused_before_anything_changes() {
    let host = SwapHost::new("unmod-refuse");
    let port = free_port();
    let mut install = unmodified(&host, 1, "b1", port, through_listener());
    install.spec.mode = Mode::Hold;
    assert_eq!(host.swap(&install).await.outcome, Outcome::Done);
    let mut wrong = unmodified(&host, 2, "b2", port, through_listener());
    wrong.spec.mode = Mode::Hold;
    if let Some(get) = wrong.spec.health.http_get.as_mut() {
        get.listener = Some("admin".into());
    }
    let result = host.swap(&wrong).await;
    assert_eq!(result.outcome, Outcome::Abandoned, "{result:?}");
    assert!(!result.executed);
    swap_host::assert_says(&result.reason, &["listener \"admin\""]);
    assert!(get(port).expect("b1 still serves").contains("build=b1"));
    host.tear_down().await;
}
