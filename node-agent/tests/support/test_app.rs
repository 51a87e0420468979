//! The test app as a plain child of the test, outside any agent: killed by
//! its pid and reaped on drop.
//!
//! Include it with `#[path = "support/test_app.rs"] mod test_app;`.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running `genswap-testapp`.
pub struct TestApp {
    child: Child,
}

impl TestApp {
    /// Serving its own unix socket `socket`, changed by `knobs`.
    pub fn start(socket: &Path, knobs: &[(&str, &str)]) -> TestApp {
        TestApp::spawn(socket, knobs)
    }

    /// Serving 127.0.0.1:`port` only, as a program that knows nothing of
    /// genswap does; `dir` holds the socket path it is told of and ignores.
    pub fn on_port(port: u16, knobs: &[(&str, &str)], dir: &Path) -> TestApp {
        let port = port.to_string();
        let mut all = vec![
            (testapp::knob::NEVER_BIND, "1"),
            (testapp::knob::PORT, port.as_str()),
        ];
        all.extend_from_slice(knobs);
        TestApp::spawn(&dir.join("unused.sock"), &all)
    }

    fn spawn(socket: &Path, knobs: &[(&str, &str)]) -> TestApp {
        let binary = testapp::binary().expect("the test app is built (cargo build -p testapp)");
        let child = Command::new(binary)
            .env(testapp::env::SOCKET, socket)
            .env(testapp::env::BUILD, "health-test")
            .env(testapp::env::GENERATION, "1")
            .envs(knobs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the test app");
        TestApp { child }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
