//! The keeper of an instance's listeners: a small process outside the
//! agent that holds copies of the listening sockets the agent holds for an
//! instance ([`crate::listeners`]) and does nothing else.
//!
//! A listening socket closes when its last descriptor does. Between
//! generations the agent's copy is the only one (a hold's gap, an exited
//! generation waiting for its restart): were the agent killed then, the
//! port would close, the connections in its backlog would be reset, and
//! new ones refused until the next agent bound it again. The keeper's copy
//! keeps it open; the next agent takes the sockets back from it
//! (`pidfd_getfd(2)`) and serves what waited.
//!
//! It is `genswap-helper listener-keeper` (or the agent's own binary run
//! so, as the log shim is: [`HelperProgram`]), in `<cgroup root>/listeners/<disk name>`: outside the agent's
//! cgroup (a pod's is killed whole when it restarts) and outside the
//! instance's (its limits and its proof of exit do not count it). It never
//! accepts, so it takes no connection from a generation. It is replaced
//! whenever the set of held sockets changes, and killed with its cgroup
//! when the instance is removed.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{SigHandler, Signal, signal};
use thiserror::Error;

use crate::cgroup::{Cgroup, CgroupError, CgroupManager};
use crate::disk_name::DiskName;
use crate::gate::InstanceKey;
use crate::logs::HelperProgram;
use crate::spawn::{ActivatedSocket, Output, SpawnSpec};

/// The subcommand the agent's binary runs as a keeper.
pub const KEEPER_COMMAND: &str = "listener-keeper";
/// How long a keeper's `cgroup.kill` may take to show `populated 0`.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// Why a keeper could not be started or stopped. The listeners still work
/// without one; only an agent killed while no generation holds them closes
/// them.
#[derive(Debug, Error)]
pub enum KeeperError {
    #[error("cannot create the keeper's cgroup {path}: {source}")]
    Cgroup {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the listener keeper: {0}")]
    Spawn(#[from] crate::spawn::SpawnError),
    #[error("cannot stop the listener keeper: {0}")]
    Stop(#[from] CgroupError),
}

/// `genswap-helper listener-keeper`: holds the descriptors it was started with
/// (3 and up) until it is killed. The signals a terminal, a pod stop or a
/// stray `kill` send are ignored: only its cgroup's `cgroup.kill` (or
/// SIGKILL) ends it.
pub fn run() -> ! {
    for sig in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGPIPE,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
    ] {
        // SAFETY: SIG_IGN installs no handler code; nothing else in this
        // process changes signal dispositions.
        let _ = unsafe { signal(sig, SigHandler::SigIgn) };
    }
    loop {
        nix::unistd::pause();
    }
}

/// Where the keepers run and what they run.
#[derive(Clone, Debug)]
pub struct KeeperSite {
    program: HelperProgram,
    dir: PathBuf,
    mount: Option<PathBuf>,
}

impl KeeperSite {
    /// Keepers that are `<program> listener-keeper` under
    /// `<cgroup root>/listeners`.
    pub fn new(program: HelperProgram, cgroups: &CgroupManager) -> KeeperSite {
        KeeperSite {
            program,
            dir: cgroups.root().join(crate::cgroup::KEEPER_CGROUP),
            mount: cgroups.mount().map(Path::to_path_buf),
        }
    }

    /// The keeper cgroup of `instance`.
    pub fn cgroup(&self, instance: &InstanceKey) -> Cgroup {
        Cgroup::at(
            self.dir.join(DiskName::of(instance).as_str()),
            self.mount.as_deref(),
        )
    }

    /// The pids of `instance`'s keepers (one, or two while it is replaced,
    /// or after an agent was killed in between).
    pub fn pids(&self, instance: &InstanceKey) -> Vec<u32> {
        self.cgroup(instance).pids().unwrap_or_default()
    }

    /// Starts a keeper of `sockets` for `instance`, then kills the keepers
    /// it replaces. With no sockets it only stops them.
    pub async fn replace(
        &self,
        instance: &InstanceKey,
        sockets: Vec<ActivatedSocket>,
    ) -> Result<(), KeeperError> {
        if sockets.is_empty() {
            return self.stop(instance).await;
        }
        let cgroup = self.cgroup(instance);
        let replaced = cgroup.pids().unwrap_or_default();
        fs::create_dir_all(cgroup.path()).map_err(|source| KeeperError::Cgroup {
            path: cgroup.path().to_path_buf(),
            source,
        })?;
        let mut spec = SpawnSpec::new(&self.program.path, cgroup, "/dev/null", 0, KEEPER_COMMAND);
        spec.argv0 = Some(self.program.name.clone());
        spec.args = vec![KEEPER_COMMAND.to_owned()];
        spec.allow_root = true;
        // The agent's own program, holding sockets: not an instance.
        spec.sandbox = None;
        spec.stdout = Output::Null;
        spec.stderr = Output::Null;
        spec.listeners = sockets;
        // Dropping the handle leaves it running; it is reaped when it dies.
        let started = crate::spawn::spawn(spec).await?;
        let cgroup = self.cgroup(instance);
        for pid in replaced.into_iter().filter(|pid| *pid != started.pid()) {
            kill_keeper(&cgroup, pid);
        }
        Ok(())
    }

    /// Kills `instance`'s keepers and removes their cgroup.
    pub async fn stop(&self, instance: &InstanceKey) -> Result<(), KeeperError> {
        let cgroup = self.cgroup(instance);
        if !cgroup.exists() {
            return Ok(());
        }
        cgroup.kill(KILL_WAIT).await?;
        cgroup.remove()?;
        Ok(())
    }

    /// The instances (by disk name) that have a keeper cgroup.
    pub fn disk_names(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// Kills the keepers in the cgroup named `disk_name` and removes it:
    /// those of an instance no longer known.
    pub async fn stop_named(&self, disk_name: &str) -> Result<(), KeeperError> {
        let cgroup = Cgroup::at(self.dir.join(disk_name), self.mount.as_deref());
        cgroup.kill(KILL_WAIT).await?;
        cgroup.remove()?;
        Ok(())
    }
}

/// SIGKILL to the replaced keeper `pid`, through a pidfd taken before its
/// membership of `cgroup` is checked, so a pid reused since is never hit.
/// One already gone is fine.
fn kill_keeper(cgroup: &Cgroup, pid: u32) {
    let Ok(pidfd) = crate::launch::pidfd_open(pid) else {
        return;
    };
    if !cgroup.pids().unwrap_or_default().contains(&pid) {
        return;
    }
    // SAFETY: pidfd_send_signal takes a pidfd we hold, a signal number, a
    // null siginfo (the kernel fills it in) and no flags.
    let _ = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_pidfd_send_signal,
            std::os::fd::AsRawFd::as_raw_fd(&pidfd),
            Signal::SIGKILL as i32,
            std::ptr::null::<nix::libc::siginfo_t>(),
            0,
        )
    };
}
