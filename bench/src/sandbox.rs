//! The child processes a benchmark starts, stopped by pid when it ends,
//! however it ends. Where it runs (temp dir, cgroup subtree) is the agent's
//! [`node_agent::sandbox::Sandbox`], re-exported here.

use std::io;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::BenchError;
pub use node_agent::sandbox::Sandbox;

/// How long a stopped child may take to go.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// A benchmark's sandbox: `genswap-bench-<label>`.
pub fn create(cgroup_parent: &std::path::Path, label: &str) -> Result<Sandbox, BenchError> {
    Sandbox::create(cgroup_parent, &format!("genswap-bench-{label}")).map_err(|error| {
        BenchError::Setup {
            what: error.what,
            source: error.source,
        }
    })
}

/// A child process stopped by its pid when dropped: the stop signal, then
/// SIGKILL if it has not exited within the wait.
pub struct Guarded {
    child: Option<Child>,
    signal: Signal,
}

impl Guarded {
    /// Guards `child`, stopped with `signal`.
    pub fn new(child: Child, signal: Signal) -> Guarded {
        Guarded {
            child: Some(child),
            signal,
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The child, to reach its stdin or stdout.
    pub fn child_mut(&mut self) -> Option<&mut Child> {
        self.child.as_mut()
    }

    /// Whether it has exited already.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends the stop signal and waits for the exit (SIGKILL after the
    /// wait), returning the exit status.
    pub fn stop(&mut self) -> io::Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(io::Error::other("already stopped"));
        };
        stop_child(&mut child, self.signal)
    }

    /// Waits for the exit without signalling, up to the stop wait.
    pub fn wait(&mut self) -> io::Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(io::Error::other("already stopped"));
        };
        let deadline = Instant::now() + STOP_WAIT;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                return stop_child(&mut child, Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = stop_child(&mut child, self.signal);
        }
    }
}

fn stop_child(child: &mut Child, signal: Signal) -> io::Result<ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
    kill(pid, signal).map_err(io::Error::from)?;
    let deadline = Instant::now() + STOP_WAIT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() > deadline {
            child.kill()?;
            return child.wait();
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
