//! SIGTERM with connections queued on the listener, not yet accepted: they
//! were made before the switch, so each must still be answered. Closing the
//! listener under them would have the kernel reset every one.

mod common;

use std::io::Write;

use common::{AppSpec, poll_until, read_reply};
use nix::sys::signal::Signal;

/// More than tokio accepts in one go (its cooperative budget is 128), so
/// some are still queued when the app sees SIGTERM.
const QUEUED: usize = 300;

#[test]
fn connections_queued_at_sigterm_are_answered() {
    let mut app = AppSpec::new().spawn();
    app.wait_for_socket();

    // Stopped, the app accepts nothing: each connect lands in the backlog.
    app.signal(Signal::SIGSTOP);
    poll_until("the app to be stopped", || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", app.pid)).ok()?;
        let state = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .next()?
            .to_string();
        (state == "T").then_some(())
    });
    let mut queued: Vec<_> = (0..QUEUED)
        .map(|_| {
            let mut stream = app.connect();
            stream
                .write_all(b"GET / HTTP/1.1\r\nHost: app\r\n\r\n")
                .expect("request written into the queued connection");
            stream
        })
        .collect();
    // SIGTERM is pending when it continues, with every connection queued.
    app.signal(Signal::SIGTERM);
    app.signal(Signal::SIGCONT);

    for (index, stream) in queued.iter_mut().enumerate() {
        let reply = read_reply(stream);
        assert_eq!(reply.status, 200, "queued connection {index}");
        assert_eq!(reply.body, app.identity(), "queued connection {index}");
    }
    assert_eq!(app.wait_exit().code(), Some(0));
}
