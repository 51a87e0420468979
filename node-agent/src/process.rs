//! A started process, by pid: awaiting its exit without holding a thread
//! (a pidfd, else SIGCHLD), and reaping it whoever drops it first.
//! [`crate::spawn`] starts generations; this is how it, the supervisor and
//! the log shims wait for what they started.

use std::io;
use std::os::fd::OwnedFd;
use std::process::ExitStatus;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::launch::{self, pidfd_open};

/// The main process and a way to await its exit without a thread.
#[derive(Debug)]
pub(crate) struct ExitWatch {
    /// `None` once handed on to a reaper.
    pid: Option<u32>,
    waker: ExitWaker,
    status: Option<ExitStatus>,
    /// Already handed to a reaper task: its own drop must not hand it on
    /// again (a runtime shutting down drops spawned tasks at once).
    orphan: bool,
}

#[derive(Debug)]
enum ExitWaker {
    /// Readable once the process has exited.
    Pidfd(AsyncFd<OwnedFd>),
    /// Any child's exit (pidfds unavailable).
    Sigchld(Option<tokio::signal::unix::Signal>),
}

impl ExitWatch {
    pub(crate) fn new(child: launch::Child) -> ExitWatch {
        let pidfd = child.pidfd.or_else(|| pidfd_open(child.pid).ok());
        let waker = match pidfd {
            Some(fd) => {
                // SAFETY: an OwnedFd is a valid open descriptor that stays
                // open, and names the same description, until the AsyncFd
                // that owns it drops.
                match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                    Ok(fd) => ExitWaker::Pidfd(fd),
                    Err(_) => sigchld_waker(),
                }
            }
            None => sigchld_waker(),
        };
        ExitWatch {
            pid: Some(child.pid),
            waker,
            status: None,
            orphan: false,
        }
    }

    pub(crate) fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.status.is_some() {
            return Ok(self.status);
        }
        let Some(pid) = self.pid else {
            return Ok(None);
        };
        self.status = wait_pid(pid, false)?;
        Ok(self.status)
    }

    pub(crate) async fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            match &mut self.waker {
                ExitWaker::Pidfd(fd) => {
                    let mut guard = fd.readable().await?;
                    let exited = match self.pid {
                        Some(pid) => wait_pid(pid, false)?,
                        None => None,
                    };
                    match exited {
                        Some(status) => {
                            self.status = Some(status);
                            return Ok(status);
                        }
                        // Readiness without an exit (spurious): wait again.
                        None => guard.clear_ready(),
                    }
                }
                ExitWaker::Sigchld(Some(signal)) => {
                    signal.recv().await;
                }
                ExitWaker::Sigchld(None) => {
                    return Err(io::Error::other(
                        "neither a pidfd nor a SIGCHLD listener is available to await the exit",
                    ));
                }
            }
        }
    }
}

impl Drop for ExitWatch {
    fn drop(&mut self) {
        if self.status.is_some() {
            return;
        }
        let Some(pid) = self.pid.take() else {
            return;
        };
        if let Ok(Some(_)) = wait_pid(pid, false) {
            return;
        }
        // Still running: reap it when it exits, so it never lingers as a
        // zombie of the agent. A task when a runtime is at hand, else (or
        // when the task itself is dropped unfinished) a thread.
        let runtime = tokio::runtime::Handle::try_current();
        match runtime {
            Ok(runtime) if !self.orphan => {
                let waker = std::mem::replace(&mut self.waker, ExitWaker::Sigchld(None));
                let mut orphan = ExitWatch {
                    pid: Some(pid),
                    waker,
                    status: None,
                    orphan: true,
                };
                runtime.spawn(async move {
                    if let Err(error) = orphan.wait().await {
                        tracing::warn!(%error, "a dropped generation process could not be reaped");
                    }
                });
            }
            _ => {
                std::thread::spawn(move || wait_pid(pid, true));
            }
        }
    }
}

/// `waitpid` for this agent's child `pid`: its status once it exited
/// (`None` while it runs, unless `block`).
fn wait_pid(pid: u32, block: bool) -> io::Result<Option<ExitStatus>> {
    use std::os::unix::process::ExitStatusExt;
    let pid = nix::libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let flags = if block { 0 } else { nix::libc::WNOHANG };
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes the status into the int it is given and
        // touches no other memory.
        let waited = unsafe { nix::libc::waitpid(pid, &mut status, flags) };
        match waited {
            0 => return Ok(None),
            w if w == pid => return Ok(Some(ExitStatus::from_raw(status))),
            _ => {
                let error = io::Error::last_os_error();
                if error.kind() != io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
        }
    }
}

/// Reaps `child` once it exits, in the background: through a pidfd awaited
/// by a task where a runtime runs (no thread held for its whole life), else
/// on a thread.
pub(crate) fn reap_when_exited(child: launch::Child) {
    drop(ExitWatch::new(child));
}

fn sigchld_waker() -> ExitWaker {
    ExitWaker::Sigchld(tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok())
}

/// Waits until `pid` has exited; `false` when that cannot be watched.
pub(crate) async fn pid_exited(pid: u32) -> bool {
    let fd = match pidfd_open(pid) {
        Ok(fd) => fd,
        // Already gone (and reaped by whoever its parent is).
        Err(error) if error.raw_os_error() == Some(nix::libc::ESRCH) => return true,
        Err(error) => {
            tracing::warn!(pid, %error, "a process's exit cannot be watched (no pidfd)");
            return false;
        }
    };
    // SAFETY: an OwnedFd is a valid open descriptor that stays open, and
    // names the same description, until the AsyncFd that owns it drops.
    match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
        Ok(fd) => fd.readable().await.is_ok(),
        Err(error) => {
            tracing::warn!(pid, %error, "a process's exit cannot be watched");
            false
        }
    }
}
