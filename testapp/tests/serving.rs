//! What the server answers, and when it binds or exits.

mod common;

use std::io::{ErrorKind, Read};
use std::time::{Duration, Instant};

use common::{AppSpec, BUILD, GENERATION, get, send_get, wait_until_peer_read};
use nix::sys::signal::Signal;
use testapp::knob;

#[test]
fn serves_its_identity_on_a_keep_alive_connection() {
    let mut app = AppSpec::new().spawn();
    app.wait_for_socket();
    let mut stream = app.connect();
    for path in ["/", "/healthz", "/any/path?x=1"] {
        let reply = get(&mut stream, path);
        assert_eq!(reply.status, 200, "{path}");
        assert_eq!(reply.body, app.identity(), "{path}");
        assert_eq!(reply.header("x-genswap-build"), Some(BUILD));
        assert_eq!(reply.header("x-genswap-generation"), Some(GENERATION));
        assert_eq!(
            reply.header("connection"),
            None,
            "keep-alive is the default"
        );
    }
    assert_eq!(
        app.identity(),
        format!("build={BUILD} generation={GENERATION} pid={}\n", app.pid)
    );
}

#[test]
fn answers_every_request_with_the_configured_status() {
    let mut app = AppSpec::new().knob(knob::STATUS, "500").spawn();
    app.wait_for_socket();
    let reply = get(&mut app.connect(), "/");
    assert_eq!(reply.status, 500);
    assert_eq!(reply.body, app.identity());
}

#[test]
fn takes_knobs_as_flags_too() {
    let mut app = AppSpec::new().arg("--status=503").spawn();
    app.wait_for_socket();
    assert_eq!(get(&mut app.connect(), "/").status, 503);
}

#[test]
fn a_bad_knob_exits_2_and_says_which() {
    let mut app = AppSpec::new().knob(knob::SLOW_MS, "soon").spawn();
    assert_eq!(app.wait_exit().code(), Some(2));
    let line = app.wait_for_log("error");
    assert!(line.contains(knob::SLOW_MS), "{line}");
}

#[test]
fn replaces_a_stale_file_at_the_socket_path() {
    let spec = AppSpec::new();
    std::fs::write(spec.socket(), b"left over by a dead generation").expect("stale file");
    let mut app = spec.spawn();
    app.wait_for_socket();
    assert_eq!(get(&mut app.connect(), "/").status, 200);
}

#[test]
fn binds_only_after_the_boot_delay() {
    let spawned = Instant::now();
    let mut app = AppSpec::new().knob(knob::BOOT_DELAY_MS, "3000").spawn();
    // Logged before the delay starts; 3 s leaves ample room to look.
    app.wait_for_log("start");
    assert!(!app.socket.exists(), "socket exists during the boot delay");
    app.wait_for_log("bound");
    assert!(spawned.elapsed() >= Duration::from_millis(3000));
    app.wait_for_socket();
    assert_eq!(get(&mut app.connect(), "/").status, 200);
}

#[test]
fn exits_after_the_configured_time_with_the_configured_code() {
    let spawned = Instant::now();
    let mut app = AppSpec::new()
        .knob(knob::EXIT_AFTER_MS, "300")
        .knob(knob::EXIT_CODE, "7")
        .spawn();
    assert_eq!(app.wait_exit().code(), Some(7));
    assert!(spawned.elapsed() >= Duration::from_millis(300));
    app.wait_for_log("exit code=7");
}

#[test]
fn exit_after_defaults_to_code_1() {
    let mut app = AppSpec::new().knob(knob::EXIT_AFTER_MS, "100").spawn();
    assert_eq!(app.wait_exit().code(), Some(1));
}

#[test]
fn never_binds_when_told_not_to() {
    let mut app = AppSpec::new().knob(knob::NEVER_BIND, "1").spawn();
    app.wait_for_log("not binding");
    assert!(!app.socket.exists(), "socket bound despite NEVER_BIND");
    assert!(app.is_running());
    app.signal(Signal::SIGTERM);
    assert_eq!(app.wait_exit().code(), Some(0));
}

#[test]
fn hang_reads_requests_but_never_answers() {
    let mut app = AppSpec::new()
        .knob(knob::HANG, "1")
        .knob(knob::DRAIN_MS, "300")
        .spawn();
    app.wait_for_socket();
    let mut stream = app.connect();
    send_get(&mut stream, "/");
    wait_until_peer_read(&stream);
    // The request has been read; an answer would follow at once.
    stream
        .set_read_timeout(Some(Duration::from_millis(1000)))
        .expect("read timeout");
    let mut buf = [0u8; 1];
    let err = stream.read(&mut buf).expect_err("a hung app answered");
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{err}"
    );

    // The drain gives up on the hung request and still exits 0.
    app.signal(Signal::SIGTERM);
    assert_eq!(app.wait_exit().code(), Some(0));
    app.wait_for_log("timed_out=true");
}

#[test]
fn fails_its_share_of_requests_but_never_its_health_check_and_counts_each_code() {
    let mut app = AppSpec::new().knob(knob::ERROR_PERCENT, "5").spawn();
    app.wait_for_socket();
    let mut stream = app.connect();
    let failed = (0..200)
        .filter(|_| get(&mut stream, "/").status == 500)
        .count();
    assert_eq!(failed, 10, "5 of every 100");
    for _ in 0..40 {
        assert_eq!(get(&mut stream, "/healthz").status, 200);
    }
    let metrics = get(&mut stream, "/metrics");
    assert_eq!(metrics.status, 200);
    let series = |code: u16, count: usize| {
        format!(
            "http_requests_total{{build=\"{BUILD}\",generation=\"{GENERATION}\",code=\"{code}\"}} {count}\n"
        )
    };
    assert!(
        metrics.body.contains(&series(500, 10)) && metrics.body.contains(&series(200, 230)),
        "the health checks count, /metrics does not:\n{}",
        metrics.body
    );
}

#[test]
fn an_error_share_above_100_is_refused() {
    let mut app = AppSpec::new().knob(knob::ERROR_PERCENT, "101").spawn();
    assert_eq!(app.wait_exit().code(), Some(2));
    assert!(app.wait_for_log("error").contains(knob::ERROR_PERCENT));
}
