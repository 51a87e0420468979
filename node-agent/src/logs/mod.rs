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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use nix::fcntl::OFlag;
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, send, socketpair};
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

/// The agent's own executable, which can also be the log shim: the name
/// works in every mount namespace, the host's joined one too.
pub const SELF_EXE: &str = "/proc/self/exe";
/// The helpers' own program, looked for beside the agent's.
pub const HELPER_NAME: &str = "genswap-helper";
/// How long a shim may take to say it is ready.
const SHIM_READY_TIMEOUT_MS: u16 = 5000;

/// The program run as each log shim (`<program> log-shim ...`) and each
/// listener keeper (`<program> listener-keeper`): `genswap-helper`, small
/// because one runs per generation and one per instance, or the agent's
/// own binary, which takes the same arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelperProgram {
    /// What is executed: a path, or `/proc/self/fd/N` of a file the agent
    /// holds open (which works in any mount namespace).
    pub path: PathBuf,
    /// Its `argv[0]`: what `ps` shows.
    pub name: String,
}

impl HelperProgram {
    /// The agent's own binary, through [`SELF_EXE`].
    pub fn agent_itself() -> HelperProgram {
        HelperProgram {
            path: PathBuf::from(SELF_EXE),
            name: "node-agent".to_owned(),
        }
    }

    /// The program at `path`, named by its file name.
    pub fn at(path: impl Into<PathBuf>) -> HelperProgram {
        let path = path.into();
        let name = path.file_name().map_or_else(
            || HELPER_NAME.to_owned(),
            |name| name.to_string_lossy().into_owned(),
        );
        HelperProgram { path, name }
    }
}

impl Default for HelperProgram {
    fn default() -> Self {
        HelperProgram::agent_itself()
    }
}

/// The log flags, as values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogSettings {
    pub dir: PathBuf,
    pub max_size: u64,
    pub max_files: u32,
    /// What runs as each shim (and each listener keeper).
    pub helper: HelperProgram,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            dir: PathBuf::from(DEFAULT_LOG_DIR),
            max_size: DEFAULT_MAX_SIZE,
            max_files: DEFAULT_MAX_FILES,
            helper: HelperProgram::default(),
        }
    }
}

impl LogSettings {
    /// The default sizes, writing under `dir` through the helper at
    /// `helper` (`genswap-helper`, or `node-agent`).
    pub fn in_dir(dir: impl Into<PathBuf>, helper: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            helper: HelperProgram::at(helper),
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
///
/// A shim's start (a fork, an exec, its setup) would be on every swap's
/// path between the intent and the exec. So the sink keeps one shim
/// started ahead, unassigned, and hands it the next generation: its start
/// happens after the attempt that took the previous one. An unassigned
/// shim holds no file and ends with [`LogSink::close`], when the sink goes,
/// or when the agent dies: its control socket reaches end-of-file.
#[derive(Clone, Debug)]
pub struct LogSink {
    settings: LogSettings,
    shim_cgroup: PathBuf,
    spare: Option<Arc<SpareSlot>>,
}

/// Where the shim started ahead waits.
#[derive(Default)]
struct SpareSlot {
    /// Held while a spare is started, so [`LogSink::close`] waits for it.
    state: Mutex<SpareState>,
    /// A spare is being started: no second one.
    refilling: AtomicBool,
}

#[derive(Default)]
struct SpareState {
    shim: Option<UnassignedShim>,
    /// No spare is started any more: the agent is stopping.
    closed: bool,
}

impl std::fmt::Debug for SpareSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpareSlot")
            .field("refilling", &self.refilling.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A started shim that has not yet been told whose output it writes:
/// killed and reaped when dropped unassigned.
struct UnassignedShim {
    child: Option<launch::Child>,
    control: OwnedFd,
    output: Option<GenerationOutput>,
}

impl UnassignedShim {
    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |child| child.pid)
    }
}

impl Drop for UnassignedShim {
    fn drop(&mut self) {
        let Some(child) = self.child.take() else {
            return;
        };
        // Never reaped yet, so the pid is still this child's.
        if let Ok(raw) = i32::try_from(child.pid) {
            let pid = nix::unistd::Pid::from_raw(raw);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, None);
        }
    }
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
            spare: Some(Arc::default()),
        })
    }

    /// Without a shim started ahead: each generation's shim starts when it
    /// is needed (for tests that count shims).
    pub fn without_spare(mut self) -> LogSink {
        self.spare = None;
        self
    }

    /// The pid of the shim started ahead, when one waits.
    pub fn spare_pid(&self) -> Option<u32> {
        let slot = self.spare.as_ref()?;
        let state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.shim.as_ref().map(UnassignedShim::pid)
    }

    /// Ends the shim started ahead and starts no other; waits for one being
    /// started. Called as the agent stops: a spare started after that would
    /// be born into a cgroup tree that is being removed.
    pub fn close(&self) {
        let Some(slot) = &self.spare else {
            return;
        };
        let spare = {
            let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.closed = true;
            state.shim.take()
        };
        // Dropped unassigned: killed and reaped.
        drop(spare);
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
        let assignment = shim::Assignment {
            dir: dir.to_path_buf(),
            generation,
            sidecar: sidecar.map(str::to_owned),
        };
        // Sidecars start after the switch, off the swap's path: the spare
        // stays for the next generation.
        let spare = sidecar.is_none().then(|| self.take_spare()).flatten();
        if let Some(spare) = spare {
            match self.assign(spare, instance, &assignment) {
                Ok(output) => return Ok(output),
                Err(error) => tracing::warn!(
                    instance = %instance,
                    generation,
                    error = %error,
                    "the log shim started ahead could not take this output; starting another"
                ),
            }
        }
        let shim = self.launch_shim()?;
        self.assign(shim, instance, &assignment)
    }

    fn take_spare(&self) -> Option<UnassignedShim> {
        let slot = self.spare.as_ref()?;
        slot.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .shim
            .take()
    }

    /// Starts a shim ahead of the next generation on a blocking thread,
    /// unless one waits or is being started (or no runtime is at hand).
    /// The engine calls it as each attempt ends, so the start happens
    /// between attempts, not on the next swap's path. Returns the start's
    /// task when one began.
    pub fn prepare_spare(&self) -> Option<tokio::task::JoinHandle<()>> {
        let slot = self.spare.as_ref()?;
        if slot.refilling.swap(true, Ordering::AcqRel) {
            return None;
        }
        let closed = slot
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .closed;
        let runtime = tokio::runtime::Handle::try_current()
            .ok()
            .filter(|_| !closed);
        let Some(runtime) = runtime else {
            slot.refilling.store(false, Ordering::Release);
            return None;
        };
        let sink = self.clone();
        Some(runtime.spawn_blocking(move || {
            let Some(slot) = &sink.spare else {
                return;
            };
            {
                // Held across the start: a swap that wants the spare meanwhile
                // waits the rest of this start rather than paying a whole one.
                let mut state = slot.state.lock().unwrap_or_else(PoisonError::into_inner);
                if !state.closed && state.shim.is_none() {
                    match sink.launch_shim() {
                        Ok(shim) => state.shim = Some(shim),
                        Err(error) => {
                            tracing::warn!(error = %error, "no log shim could be started ahead; the next generation's starts when it is needed");
                        }
                    }
                }
            }
            slot.refilling.store(false, Ordering::Release);
        }))
    }

    /// Starts a shim in the shims' cgroup, holding the read ends of a fresh
    /// pair of pipes; it waits for its assignment.
    fn launch_shim(&self) -> Result<UnassignedShim, LogError> {
        let exe = &self.settings.helper.path;
        let start_err = |source: io::Error| LogError::Start {
            exe: exe.clone(),
            source,
        };
        let pipe =
            || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|source| start_err(source.into()));
        let (out_read, out_write) = pipe()?;
        let (err_read, err_write) = pipe()?;
        let (control, shim_control) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|source| start_err(source.into()))?;
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
            (high(&shim_control)?, shim::CONTROL_FD),
        ];
        drop((out_read, err_read, shim_control));
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
        let args = [
            shim::SHIM_COMMAND.to_owned(),
            "--max-size".to_owned(),
            self.settings.max_size.to_string(),
            "--max-files".to_owned(),
            self.settings.max_files.to_string(),
        ];
        let image = ExecImage::named(exe, Some(&self.settings.helper.name), &args, &[], None)
            .map_err(start_err)?;
        // The shims' cgroup again if something removed it, but never the
        // agent's root above it: that is gone only when the agent stops.
        match fs::create_dir(&self.shim_cgroup) {
            Err(source) if source.kind() != io::ErrorKind::AlreadyExists => {
                return Err(LogError::Cgroup {
                    path: self.shim_cgroup.clone(),
                    source,
                });
            }
            _ => {}
        }
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
        match launched {
            Launched::Running(child) => Ok(UnassignedShim {
                child: Some(child),
                control,
                output: Some(GenerationOutput {
                    stdout: out_write,
                    stderr: err_write,
                }),
            }),
            Launched::ExecFailed(errno)
            | Launched::StepFailed {
                errno: Some(errno), ..
            } => Err(start_err(errno.into())),
            Launched::StepFailed { errno: None, .. } | Launched::Vanished => Err(start_err(
                io::Error::other("it ended before it reported its setup"),
            )),
        }
    }

    /// Tells `shim` whose output it writes and waits for its answer.
    fn assign(
        &self,
        mut shim: UnassignedShim,
        instance: &InstanceKey,
        assignment: &shim::Assignment,
    ) -> Result<GenerationOutput, LogError> {
        let message = assignment.encode();
        let answer = if message.len() > shim::MAX_ASSIGNMENT {
            Err(format!(
                "its assignment is {} bytes, more than {} (the log directory's path is too long)",
                message.len(),
                shim::MAX_ASSIGNMENT
            ))
        } else {
            send(shim.control.as_raw_fd(), &message, MsgFlags::MSG_NOSIGNAL)
                .map_err(|errno| format!("its assignment could not be sent: {errno}"))
                .and_then(|_| await_ready(&shim.control))
        };
        match answer {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                instance = %instance,
                generation = assignment.generation,
                dir = %assignment.dir.display(),
                "the log shim cannot open the log file; this generation's output is read and dropped"
            ),
            Err(why) => {
                // Dead or wedged (dropping it kills it): a generation must
                // not write into a pipe nobody reads.
                return Err(LogError::NotReady {
                    exe: self.settings.helper.path.clone(),
                    pid: shim.pid(),
                    why,
                });
            }
        }
        match (shim.child.take(), shim.output.take()) {
            (Some(child), Some(output)) => {
                crate::process::reap_when_exited(child);
                Ok(output)
            }
            _ => Err(LogError::NotReady {
                exe: self.settings.helper.path.clone(),
                pid: shim.pid(),
                why: "it was handed out twice".into(),
            }),
        }
    }
}

/// Waits for the shim's ready byte: it answers its assignment with one once
/// its log file is open, then closes its end. `false`: it runs without its
/// log file.
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
