//! Processes a test starts: their output in a log file, stopped by PID
//! when the guard drops, whatever the test did.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How long a process has to stop after SIGTERM before it is SIGKILLed.
const STOP_DEADLINE: Duration = Duration::from_secs(30);

/// A process a test started; stopped by PID on drop (SIGTERM, then
/// SIGKILL after 30 s), its log kept for diagnosis.
pub struct ChildGuard {
    /// For messages.
    pub name: String,
    child: Child,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

impl ChildGuard {
    /// Starts `command` with its output in `log`.
    pub fn spawn(name: impl Into<String>, mut command: Command, log: PathBuf) -> Self {
        let name = name.into();
        let file = fs::File::create(&log)
            .unwrap_or_else(|e| panic!("create the log file {}: {e}", log.display()));
        let err = file.try_clone().expect("clone the log file");
        let child = command
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        ChildGuard { name, child, log }
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Panics, with its log, when the process has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited ({status}); its log:\n{}",
                self.name,
                tail(&self.log, 60)
            );
        }
    }

    /// Sends `signal`.
    pub fn signal(&self, signal: Signal) {
        if let Ok(raw) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(raw), signal);
        }
    }

    /// SIGTERM, then SIGKILL after 30 s; how it ended.
    pub fn stop(&mut self) -> ExitStatus {
        if let Ok(Some(status)) = self.child.try_wait() {
            return status;
        }
        self.signal(Signal::SIGTERM);
        let deadline = Instant::now() + STOP_DEADLINE;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        self.child
            .wait()
            .unwrap_or_else(|e| panic!("wait for {}: {e}", self.name))
    }

    /// SIGKILL, and the reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The last `lines` lines of its log.
    pub fn tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
