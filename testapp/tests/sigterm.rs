//! SIGTERM: graceful drain, ignoring it, and children that outlive the app.

mod common;

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::os::unix::net::UnixStream;

use common::{
    AppSpec, KillOnDrop, assert_closed_by_server, children_of, get, ignores_sigterm, is_alive,
    poll_until, read_reply, send_get, wait_until_peer_read,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use testapp::knob;

#[test]
fn sigterm_closes_idle_connections_finishes_in_flight_ones_and_exits_0() {
    let mut app = AppSpec::new()
        .knob(knob::SLOW_MS, "2500")
        .knob(knob::DRAIN_MS, "20000")
        .spawn();
    app.wait_for_socket();

    let mut idle = app.connect();
    assert_eq!(get(&mut idle, "/").status, 200);
    let mut in_flight = app.connect();
    send_get(&mut in_flight, "/");
    // Once read, the request is in flight for SLOW_MS.
    wait_until_peer_read(&in_flight);

    app.signal(Signal::SIGTERM);
    assert_closed_by_server(&mut idle);
    app.wait_for_log("draining");
    let refused = UnixStream::connect(&app.socket).expect_err("still accepting while draining");
    assert_eq!(refused.kind(), ErrorKind::ConnectionRefused, "{refused}");

    let reply = read_reply(&mut in_flight);
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, app.identity());
    assert_eq!(reply.header("connection"), Some("close"));
    assert_closed_by_server(&mut in_flight);

    assert_eq!(app.wait_exit().code(), Some(0));
    app.wait_for_log("timed_out=false");
}

#[test]
fn ignoring_sigterm_keeps_serving() {
    let mut app = AppSpec::new().knob(knob::IGNORE_SIGTERM, "1").spawn();
    app.wait_for_socket();
    // With SIG_IGN the kernel discards SIGTERM on sending, so nothing is pending.
    assert!(ignores_sigterm(app.pid));
    app.signal(Signal::SIGTERM);
    for _ in 0..5 {
        assert_eq!(get(&mut app.connect(), "/").status, 200);
    }
    assert!(app.is_running());
    assert!(
        !app.drain_log().iter().any(|line| line.contains("draining")),
        "drained despite IGNORE_SIGTERM"
    );
}

#[test]
fn forked_children_ignore_sigterm_hold_no_socket_and_outlive_the_app() {
    let mut app = AppSpec::new().knob(knob::FORK_CHILDREN, "2").spawn();
    app.wait_for_socket();
    let children = poll_until("two children", || {
        let children = children_of(app.pid);
        (children.len() == 2).then_some(children)
    });
    let guard = KillOnDrop(children.clone());

    let logged: BTreeSet<String> = app
        .drain_log()
        .iter()
        .filter_map(|line| line.split("forked child pid=").nth(1))
        .map(str::to_string)
        .collect();
    let found: BTreeSet<String> = children.iter().map(Pid::to_string).collect();
    assert_eq!(logged, found);

    for child in &children {
        assert!(ignores_sigterm(*child), "child {child}");
        let fds = std::fs::read_dir(format!("/proc/{child}/fd")).expect("child fds");
        for fd in fds.flatten() {
            let target = std::fs::read_link(fd.path()).expect("fd link");
            assert!(
                !target.to_string_lossy().starts_with("socket:"),
                "child {child} holds {target:?}"
            );
        }
    }

    app.signal(Signal::SIGTERM);
    assert_eq!(app.wait_exit().code(), Some(0));
    for child in &children {
        assert!(is_alive(*child), "child {child} died with the app");
        kill(*child, Signal::SIGTERM).expect("signal child");
        assert!(is_alive(*child), "child {child} died of SIGTERM");
    }
    drop(guard);
}
