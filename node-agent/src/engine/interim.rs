//! A stand-in for `crate::spawn` until it lands: a child placed in its cgroup
//! before exec, with its uid/gid and no_new_privs.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::process::ExitStatus;

use thiserror::Error;

/// Why a start failed.
#[derive(Debug, Error)]
pub enum SpawnError {
    /// Refused before fork.
    #[error("{0}")]
    Refused(String),
    /// The exec failed.
    #[error("exec of {program} failed: {source}")]
    Exec {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Waiting failed.
    #[error("waiting for pid {pid} failed: {source}")]
    Wait {
        /// The pid.
        pid: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl SpawnError {
    /// Nothing ran.
    pub fn is_refusal(&self) -> bool {
        matches!(self, SpawnError::Refused(_))
    }

    /// A process of the build may have run.
    pub fn may_have_run(&self) -> bool {
        matches!(self, SpawnError::Wait { .. })
    }
}

/// A started generation's main process.
#[derive(Debug)]
pub struct Child {
    inner: tokio::process::Child,
    pid: u32,
    status: Option<ExitStatus>,
}

impl Child {
    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits for its exit.
    pub async fn wait(&mut self) -> Result<ExitStatus, SpawnError> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let status = self.inner.wait().await.map_err(|source| SpawnError::Wait {
            pid: self.pid,
            source,
        })?;
        self.status = Some(status);
        Ok(status)
    }

    /// Its exit status if it has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, SpawnError> {
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        let status = self.inner.try_wait().map_err(|source| SpawnError::Wait {
            pid: self.pid,
            source,
        })?;
        self.status = status;
        Ok(status)
    }
}

/// Starts `program` inside the cgroup whose `cgroup.procs` is `procs`.
pub fn start(
    program: &Path,
    args: &[String],
    env: &[(String, String)],
    working_dir: Option<&Path>,
    uid: Option<u32>,
    gid: Option<u32>,
    procs: &Path,
) -> Result<Child, SpawnError> {
    let procs_fd: OwnedFd = std::fs::OpenOptions::new()
        .write(true)
        .open(procs)
        .map_err(|e| SpawnError::Refused(format!("open {}: {e}", procs.display())))?
        .into();
    let mut command = tokio::process::Command::new(program);
    command.args(args).env_clear();
    for (name, value) in env {
        command.env(name, value);
    }
    if let Some(dir) = working_dir {
        command.current_dir(dir);
    }
    command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit());
    let raw = procs_fd.as_raw_fd();
    // SAFETY: the closure only makes async-signal-safe system calls (write,
    // setgroups, setgid, setuid, prctl) on values prepared before the fork.
    unsafe {
        command.pre_exec(move || {
            let fd = std::os::fd::BorrowedFd::borrow_raw(raw);
            nix::unistd::write(fd, b"0")?;
            if let Some(gid) = gid {
                nix::unistd::setgroups(&[])?;
                nix::unistd::setgid(nix::unistd::Gid::from_raw(gid))?;
            }
            if let Some(uid) = uid {
                nix::unistd::setuid(nix::unistd::Uid::from_raw(uid))?;
            }
            if nix::libc::prctl(nix::libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let inner = command.spawn().map_err(|source| SpawnError::Exec {
        program: program.display().to_string(),
        source,
    })?;
    drop(procs_fd);
    let pid = inner.id().unwrap_or(0);
    Ok(Child {
        inner,
        pid,
        status: None,
    })
}
