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

use nix::fcntl::OFlag;
use thiserror::Error;

use crate::cgroup::CgroupManager;
use crate::disk_name::DiskName;
use crate::gate::InstanceKey;
use crate::launch::{self, ChildStep, ExecImage, Launch, LaunchError, Launched};

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
        let dir = self.made_instance_dir(instance)?;
        let mut keep: Vec<u64> = file::generations_in(&dir);
        keep.retain(|n| *n < generation);
        let newest = keep.len().saturating_sub(GENERATIONS_KEPT - 1);
        let mut keep = keep.split_off(newest);
        keep.extend(serving);
        keep.push(generation);
        file::prune(&dir, &keep);
        self.start_shim(instance, &dir, generation, None)
    }

    /// Starts the shim for sidecar `name` of `generation`: its output goes
    /// to `<N>-<name>.log` beside the generation's, and is pruned with it.
    pub fn start_sidecar(
        &self,
        instance: &InstanceKey,
        generation: u64,
        name: &str,
    ) -> Result<GenerationOutput, LogError> {
        let dir = self.made_instance_dir(instance)?;
        self.start_shim(instance, &dir, generation, Some(name))
    }

    /// The log directory of `instance`, made, with its disk-name record.
    fn made_instance_dir(&self, instance: &InstanceKey) -> Result<PathBuf, LogError> {
        let dir = self.instance_dir(instance);
        fs::create_dir_all(&dir)
            .and_then(|()| crate::disk_name::write_record(&dir, instance))
            .map_err(|source| LogError::Dir {
                path: dir.clone(),
                source,
            })?;
        Ok(dir)
    }

    fn start_shim(
        &self,
        instance: &InstanceKey,
        dir: &Path,
        generation: u64,
        sidecar: Option<&str>,
    ) -> Result<GenerationOutput, LogError> {
        let pipe = || {
            nix::unistd::pipe2(OFlag::O_CLOEXEC)
                .map_err(|source| LogError::Pipe { generation, source })
        };
        let (out_read, out_write) = pipe()?;
        let (err_read, err_write) = pipe()?;
        let (ready_read, ready_write) = pipe()?;
        let exe = &self.settings.shim;
        let start_err = |source: io::Error| LogError::Start {
            exe: exe.clone(),
            source,
        };
        let null: OwnedFd = fs::File::open("/dev/null").map_err(start_err)?.into();
        // Above the descriptors the child places them at, so no dup2 there
        // overwrites another's source.
        let high =
            |fd: &OwnedFd| launch::fd_at_least(fd, launch::SETUP_FD_FLOOR).map_err(start_err);
        let held = [
            (high(&null)?, 0),
            (high(&null)?, 1),
            (high(&null)?, 2),
            (high(&out_read)?, shim::STDOUT_FD),
            (high(&err_read)?, shim::STDERR_FD),
            (high(&ready_write)?, shim::READY_FD),
        ];
        drop((out_read, err_read, ready_write));
        let steps = held
            .iter()
            .map(|(fd, to)| {
                let step = ChildStep::Dup2 {
                    from: fd.as_raw_fd(),
                    to: *to,
                };
                (b'o', step)
            })
            .collect();
        let mut args = vec![
            "log-shim".to_owned(),
            "--dir".to_owned(),
            dir.display().to_string(),
            "--generation".to_owned(),
            generation.to_string(),
            "--max-size".to_owned(),
            self.settings.max_size.to_string(),
            "--max-files".to_owned(),
            self.settings.max_files.to_string(),
        ];
        if let Some(name) = sidecar {
            args.extend(["--sidecar".to_owned(), name.to_owned()]);
        }
        let image = ExecImage::new(exe, &args, &[], None).map_err(start_err)?;
        fs::create_dir_all(&self.shim_cgroup).map_err(|source| LogError::Cgroup {
            path: self.shim_cgroup.clone(),
            source,
        })?;
        // Born in the shims' cgroup: a move there afterwards would wait for
        // the kernel's cgroup lock (see crate::launch).
        let launch = Launch {
            cgroup: self.shim_cgroup.clone(),
            steps,
            image,
        };
        let launched = launch.start().map_err(|error| match error {
            LaunchError::OpenCgroup { path, source } | LaunchError::Refused { path, source } => {
                LogError::Cgroup { path, source }
            }
            LaunchError::Start(source) => start_err(source),
        })?;
        drop(held);
        let child = match launched {
            Launched::Running(child) => child,
            Launched::ExecFailed(errno)
            | Launched::StepFailed {
                errno: Some(errno), ..
            } => {
                return Err(start_err(errno.into()));
            }
            Launched::StepFailed { errno: None, .. } | Launched::Vanished => {
                return Err(start_err(io::Error::other(
                    "it ended before it reported its setup",
                )));
            }
        };
        let pid = child.pid;
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
                if let Ok(raw) = i32::try_from(pid) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(raw),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                crate::process::reap_when_exited(child);
                return Err(LogError::NotReady {
                    exe: exe.clone(),
                    pid,
                    why,
                });
            }
        }
        crate::process::reap_when_exited(child);
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
