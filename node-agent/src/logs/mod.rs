//! Where a generation's stdout and stderr go (SPEC 5.11).
//!
//! Never to the agent: each generation gets two pipes whose reader is a log
//! shim ([`shim`]) started for it, which writes
//! `<log dir>/<namespace>_<name>/<N>.log` in the kubelet's CRI format
//! ([`cri`]), rotated by size ([`file`]). The shim outlives the agent, so an
//! agent restart (a DaemonSet pod restart closes the container's own
//! output) loses no line and never makes an instance's write fail.
//!
//! The shims live in one cgroup of their own, `<cgroup root>/logs`, outside
//! the agent's (a pod's cgroup is killed whole when the pod restarts) and
//! outside the generations' (their memory and pids limits do not count it,
//! and the proof that a generation stopped does not wait for its shim).

pub mod cri;
pub mod file;
pub mod read;
pub mod shim;

use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{FcntlArg, OFlag, fcntl};
use thiserror::Error;

use crate::cgroup::CgroupManager;
use crate::disk_name::DiskName;
use crate::gate::InstanceKey;

/// The default log directory.
pub const DEFAULT_LOG_DIR: &str = "/var/log/genswap";
/// The default size at which a log file is rotated (the kubelet's).
pub const DEFAULT_MAX_SIZE: u64 = 10 * 1024 * 1024;
/// The default number of files kept per generation (the kubelet's).
pub const DEFAULT_MAX_FILES: u32 = 5;
/// The cgroup the shims run in, under the agent's cgroup root.
pub use crate::cgroup::SHIM_CGROUP;
/// Generations whose logs are kept besides the serving one: the newest few,
/// so the output of a failed successor is there to read after it.
pub const GENERATIONS_KEPT: usize = 3;

/// The agent's own executable, which is also the log shim: the name works
/// in every mount namespace, the host's joined one too.
pub const SELF_EXE: &str = "/proc/self/exe";
/// How long a shim may take to say it is ready.
const SHIM_READY_TIMEOUT_MS: u16 = 5000;

/// The log flags, as values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogSettings {
    pub dir: PathBuf,
    pub max_size: u64,
    pub max_files: u32,
    /// The program that is run as `<shim> log-shim`: the agent itself
    /// ([`SELF_EXE`]); tests name the built `node-agent` binary.
    pub shim: PathBuf,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            dir: PathBuf::from(DEFAULT_LOG_DIR),
            max_size: DEFAULT_MAX_SIZE,
            max_files: DEFAULT_MAX_FILES,
            shim: PathBuf::from(SELF_EXE),
        }
    }
}

impl LogSettings {
    /// The default sizes, writing under `dir` through `shim`.
    pub fn in_dir(dir: impl Into<PathBuf>, shim: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            shim: shim.into(),
            ..Self::default()
        }
    }
}

/// `<log dir>/<namespace>_<name>`, or the cut form of a long key
/// ([`DiskName::log_dir_name`]).
pub fn instance_dir(log_dir: &Path, instance: &InstanceKey) -> PathBuf {
    log_dir.join(DiskName::of(instance).log_dir_name())
}

/// Why a generation's log could not be set up.
#[derive(Debug, Error)]
pub enum LogError {
    #[error("cannot create the log directory {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot create the log shims' cgroup {path}: {source}")]
    Cgroup {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot make the pipes for generation {generation}'s output: {source}")]
    Pipe {
        generation: u64,
        #[source]
        source: nix::Error,
    },
    #[error("cannot start the log shim {exe}: {source}")]
    Start {
        exe: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the log shim {exe} (pid {pid}) did not say it was ready: {why}")]
    NotReady { exe: PathBuf, pid: u32, why: String },
    #[error("cannot move the log shim (pid {pid}) into {path}: {source}")]
    Place {
        pid: u32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The write ends a generation gets as its stdout and stderr.
#[derive(Debug)]
pub struct GenerationOutput {
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Starts a log shim per generation.
#[derive(Clone, Debug)]
pub struct LogSink {
    settings: LogSettings,
    shim_cgroup: PathBuf,
}

impl LogSink {
    /// A sink writing under `settings.dir`, whose shims are `<shim>
    /// log-shim` placed in `<cgroup root>/logs`. Creates both directories.
    pub fn new(settings: LogSettings, cgroups: &CgroupManager) -> Result<LogSink, LogError> {
        fs::create_dir_all(&settings.dir).map_err(|source| LogError::Dir {
            path: settings.dir.clone(),
            source,
        })?;
        let shim_cgroup = cgroups.root().join(SHIM_CGROUP);
        fs::create_dir_all(&shim_cgroup).map_err(|source| LogError::Cgroup {
            path: shim_cgroup.clone(),
            source,
        })?;
        Ok(LogSink {
            settings,
            shim_cgroup,
        })
    }

    pub fn settings(&self) -> &LogSettings {
        &self.settings
    }

    /// The log directory of `instance`.
    pub fn instance_dir(&self, instance: &InstanceKey) -> PathBuf {
        instance_dir(&self.settings.dir, instance)
    }

    /// Starts the shim for `generation` of `instance` and returns the pipe
    /// ends the generation writes to. First deletes the logs of older
    /// generations but `serving` and the newest [`GENERATIONS_KEPT`].
    pub fn start(
        &self,
        instance: &InstanceKey,
        generation: u64,
        serving: Option<u64>,
    ) -> Result<GenerationOutput, LogError> {
        let dir = self.instance_dir(instance);
        fs::create_dir_all(&dir)
            .and_then(|()| crate::disk_name::write_record(&dir, instance))
            .map_err(|source| LogError::Dir {
                path: dir.clone(),
                source,
            })?;
        let mut keep: Vec<u64> = file::generations_in(&dir);
        keep.retain(|n| *n < generation);
        let newest = keep.len().saturating_sub(GENERATIONS_KEPT - 1);
        let mut keep = keep.split_off(newest);
        keep.extend(serving);
        keep.push(generation);
        file::prune(&dir, &keep);

        let pipe = || {
            nix::unistd::pipe2(OFlag::O_CLOEXEC)
                .map_err(|source| LogError::Pipe { generation, source })
        };
        let (out_read, out_write) = pipe()?;
        let (err_read, err_write) = pipe()?;
        // Above the descriptors the child moves them to, so neither dup2
        // there can overwrite the other's source.
        let high = |fd: OwnedFd| -> Result<OwnedFd, LogError> {
            let raw = fcntl(&fd, FcntlArg::F_DUPFD_CLOEXEC(10))
                .map_err(|source| LogError::Pipe { generation, source })?;
            // SAFETY: fcntl just returned this new descriptor; nothing else owns it.
            Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) })
        };
        let out_read = high(out_read)?;
        let err_read = high(err_read)?;
        let (ready_read, ready_write) = pipe()?;
        let ready_write = high(ready_write)?;
        let (out_raw, err_raw, ready_raw) = (
            out_read.as_raw_fd(),
            err_read.as_raw_fd(),
            ready_write.as_raw_fd(),
        );
        let exe = &self.settings.shim;

        let mut command = std::process::Command::new(exe);
        command
            .arg("log-shim")
            .arg("--dir")
            .arg(&dir)
            .arg("--generation")
            .arg(generation.to_string())
            .arg("--max-size")
            .arg(self.settings.max_size.to_string())
            .arg("--max-files")
            .arg(self.settings.max_files.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .env_clear();
        // SAFETY: the hook runs in the forked child before exec and calls
        // only dup2, which is async-signal-safe, on descriptors the parent
        // keeps open until spawn returns.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                for (from, to) in [
                    (out_raw, shim::STDOUT_FD),
                    (err_raw, shim::STDERR_FD),
                    (ready_raw, shim::READY_FD),
                ] {
                    if nix::libc::dup2(from, to) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|source| LogError::Start {
            exe: exe.clone(),
            source,
        })?;
        drop((out_read, err_read, ready_write));
        let pid = child.id();
        let mut child = child;
        match await_ready(&ready_read) {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                instance = %instance,
                generation,
                dir = %dir.display(),
                "the log shim cannot open the log file; this generation's output is read and dropped"
            ),
            Err(why) => {
                // Dead or wedged: a generation must not write into a pipe
                // nobody reads.
                let _ = child.kill();
                crate::spawn::reap_when_exited(child);
                return Err(LogError::NotReady {
                    exe: exe.clone(),
                    pid,
                    why,
                });
            }
        }
        crate::spawn::reap_when_exited(child);
        let procs = self.shim_cgroup.join("cgroup.procs");
        let placed =
            fs::create_dir_all(&self.shim_cgroup).and_then(|()| fs::write(&procs, pid.to_string()));
        if let Err(source) = placed {
            // Left in the agent's cgroup it would die with the agent's
            // pod; closing the write ends makes it exit.
            return Err(LogError::Place {
                pid,
                path: self.shim_cgroup.clone(),
                source,
            });
        }
        Ok(GenerationOutput {
            stdout: out_write,
            stderr: err_write,
        })
    }
}

/// Waits for the shim's ready byte: it writes one once its signals are
/// ignored and its pipes taken, then closes the descriptor. `false`: it
/// runs without its log file.
fn await_ready(ready: &OwnedFd) -> Result<bool, String> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [PollFd::new(ready.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(SHIM_READY_TIMEOUT_MS)) {
        Ok(0) => return Err(format!("no answer in {SHIM_READY_TIMEOUT_MS} ms")),
        Ok(_) => {}
        Err(errno) => return Err(format!("poll: {errno}")),
    }
    let mut byte = [0u8; 1];
    match nix::unistd::read(ready, &mut byte) {
        Ok(1) if byte[0] == shim::READY => Ok(true),
        // It reads on, so the generation can run; what it writes is lost.
        Ok(1) if byte[0] == shim::READY_WITHOUT_FILE => Ok(false),
        Ok(0) => Err("it exited first".into()),
        Ok(_) => Err("it answered something else".into()),
        Err(errno) => Err(format!("read: {errno}")),
    }
}
