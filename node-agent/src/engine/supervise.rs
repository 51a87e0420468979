//! Supervision between attempts (SPEC 5.10), its first part: a serving
//! generation's exit is noticed at once and handled.
//!
//! Each generation the engine holds as serving while no attempt runs is
//! watched by a task awaiting a pidfd of its main process (registered with
//! tokio: no polling loop). When it becomes readable the process has
//! exited, and [`Engine::supervise`] handles it: it reaps the process (no
//! zombie of the agent), reads whether the kernel OOM-killed anything in its
//! cgroup, stops whatever the generation left running there with proof of
//! exit, removes its cgroup, socket and `current.sock`, and journals that
//! nothing serves and how the generation ended. An exit during an attempt is
//! the attempt's to meet; the watch is set again when the attempt hands the
//! generation back, and fires at once if it is already gone.
//!
//! Restarting the instance (`restartPolicy`, backoff) and reporting the
//! exit in status are not done yet: the adapters log and count each exit.

use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use super::{Engine, Running, parts};
use crate::gate::InstanceKey;
use crate::journal::{ExitRecord, unix_millis_now};

/// Logs a handled exit, the way both intakes report it for now.
pub fn log_exit(exit: &GenerationExit) {
    tracing::warn!(
        instance = %exit.instance,
        generation = exit.exit.generation,
        build = %exit.exit.build,
        exit = %exit.describe(),
        "a serving generation exited between attempts; nothing serves the instance now"
    );
}

/// A serving generation that exited between attempts, as handled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerationExit {
    pub instance: InstanceKey,
    pub exit: ExitRecord,
}

impl GenerationExit {
    /// `exit code 0`, `signal 9 (OOM-killed)`, `unknown (adopted)`.
    pub fn describe(&self) -> String {
        let how = parts::exit_text(self.exit.exit_code, self.exit.signal);
        if self.exit.oom_killed {
            format!("{how} (OOM-killed)")
        } else {
            how
        }
    }

    /// A metric label: `oom_killed`, `signaled`, `exited`, `unknown`.
    pub fn reason(&self) -> &'static str {
        match (self.exit.oom_killed, self.exit.exit_code, self.exit.signal) {
            (true, _, _) => "oom_killed",
            (false, _, Some(_)) => "signaled",
            (false, Some(_), None) => "exited",
            (false, None, None) => "unknown",
        }
    }
}

/// Where the watch tasks say which generation exited.
#[derive(Debug)]
pub(super) struct ExitNotices {
    sender: mpsc::UnboundedSender<(InstanceKey, u64)>,
    receiver: Mutex<Option<mpsc::UnboundedReceiver<(InstanceKey, u64)>>>,
}

impl ExitNotices {
    pub(super) fn new() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Self {
            sender,
            receiver: Mutex::new(Some(receiver)),
        }
    }

    /// Starts the watch of `running`'s main process.
    pub(super) fn watch(&self, instance: &InstanceKey, running: &Running) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (sender, instance) = (self.sender.clone(), instance.clone());
        let (generation, pid) = (running.record.n, running.process.pid());
        runtime.spawn(async move {
            if exited(pid).await {
                let _ = sender.send((instance, generation));
            }
        });
    }
}

/// Waits until `pid` has exited; `false` when that cannot be watched.
async fn exited(pid: u32) -> bool {
    let fd = match crate::spawn::pidfd_open(pid) {
        Ok(fd) => fd,
        // Already gone (and reaped by whoever its parent is).
        Err(error) if error.raw_os_error() == Some(nix::libc::ESRCH) => return true,
        Err(error) => {
            tracing::warn!(pid, %error, "a serving generation's exit cannot be watched (no pidfd)");
            return false;
        }
    };
    // SAFETY: an OwnedFd is a valid open descriptor that stays open, and
    // names the same description, until the AsyncFd that owns it drops.
    match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
        Ok(fd) => fd.readable().await.is_ok(),
        Err(error) => {
            tracing::warn!(pid, %error, "a serving generation's exit cannot be watched");
            false
        }
    }
}

/// The supervisor's task; dropping it stops the supervisor (an exit it was
/// handling is left to the next start's recovery).
#[derive(Debug)]
pub struct Supervisor(tokio::task::JoinHandle<()>);

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Engine {
    /// Runs [`supervise`](Self::supervise) as a task for as long as the
    /// returned guard lives: what an intake keeps while it runs.
    pub fn start_supervisor(
        self: &Arc<Self>,
        on_exit: impl FnMut(GenerationExit) + Send + 'static,
    ) -> Supervisor {
        let engine = Arc::clone(self);
        Supervisor(tokio::spawn(async move { engine.supervise(on_exit).await }))
    }

    /// Handles each serving generation's exit as it happens, calling
    /// `on_exit` once for each. It never returns on its own (the engine
    /// keeps the sending side): intakes run it through
    /// [`start_supervisor`](Self::start_supervisor). A second call returns
    /// at once.
    pub async fn supervise(&self, mut on_exit: impl FnMut(GenerationExit) + Send) {
        let receiver = self
            .exits
            .receiver
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(mut receiver) = receiver else {
            return;
        };
        while let Some((instance, generation)) = receiver.recv().await {
            if let Some(exit) = self.handle_exit(&instance, generation).await {
                on_exit(exit);
            }
        }
    }

    async fn handle_exit(&self, instance: &InstanceKey, generation: u64) -> Option<GenerationExit> {
        self.forget_watch(instance, generation);
        // A retired generation's watch, or an attempt running (which meets
        // the exit itself, and watches again after): nothing to claim.
        let serves = self.lock_instances().get(instance).is_some_and(|state| {
            !state.busy
                && state
                    .serving
                    .as_ref()
                    .is_some_and(|running| running.record.n == generation)
        });
        if !serves {
            return None;
        }
        let mut claim = self.claim(instance)?;
        if claim
            .serving
            .as_ref()
            .is_none_or(|running| running.record.n != generation)
        {
            return None;
        }
        let mut running = claim.serving.take()?;
        let status = parts::has_exited(&mut running);
        let (exit_code, signal) = (
            status.and_then(|s| s.code()),
            status.and_then(|s| s.signal()),
        );
        let exit = ExitRecord {
            generation,
            build: running.record.build.clone(),
            exit_code,
            signal,
            oom_killed: oom_killed(&running),
            at_ms: unix_millis_now(),
        };
        let stop = running.record.stop.clone().unwrap_or_default();
        if let Err((running, error)) = parts::stop_generation(running, &stop).await {
            tracing::error!(
                instance = %instance,
                generation,
                error = %super::flow::reason_of(&error),
                "what an exited generation left in its cgroup could not be proven stopped"
            );
            claim.serving = Some(running);
            return None;
        }
        parts::remove_current_link(&self.layout, instance);
        let journal = Arc::clone(&self.journal);
        let (key, record) = (instance.clone(), exit.clone());
        if let Err(error) = parts::blocking(move || journal.record_exit(&key, record)).await {
            tracing::error!(instance = %instance, error = %super::flow::reason_of(&error), "the exit could not be journaled; recovery finds it");
        }
        Some(GenerationExit {
            instance: instance.clone(),
            exit,
        })
    }
}

/// `oom_kill` above 0 in the generation cgroup's `memory.events` (each
/// generation's cgroup is fresh, so any count is its own).
fn oom_killed(running: &Running) -> bool {
    std::fs::read_to_string(running.cgroup.path().join("memory.events"))
        .ok()
        .and_then(|events| {
            events
                .lines()
                .find_map(|line| line.strip_prefix("oom_kill "))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .is_some_and(|kills| kills > 0)
}
