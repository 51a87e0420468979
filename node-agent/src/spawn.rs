//! Starting a generation inside its fresh cgroup.
//!
//! [`spawn`] forks, and the child, before it executes anything of the build,
//! joins its generation cgroup, starts a new session, sets no_new_privs,
//! drops to the instance's uid/gid and changes directory; then it execs the
//! store copy of the build with a clean environment (the spec's variables, a
//! minimal `PATH`, and `GENSWAP_SOCKET`, `GENSWAP_GENERATION`,
//! `GENSWAP_BUILD`).
//!
//! # Placement
//!
//! The child writes `0` to its cgroup's `cgroup.procs` in a `pre_exec` hook,
//! through a descriptor the parent opened before the fork. So the build's
//! first instruction already runs in its cgroup, and everything it forks
//! stays there. `clone3(CLONE_INTO_CGROUP)` would do the same one step
//! earlier, but needs a raw clone and a hand-written exec path; std's
//! Command is proven and keeps the unsafe surface to one hook.
//!
//! # Telling "nothing ran" from "the build failed"
//!
//! std reports a failure of the hook and a failure of the exec through the
//! same `io::Error`. The hook therefore also writes one byte to a
//! close-on-exec status pipe of its own: the code of the [`SetupStep`] that
//! failed, or a final "exec next" byte once every step passed. The parent
//! reads it after the spawn returns:
//!
//! | spawn | byte | error | meaning |
//! | --- | --- | --- | --- |
//! | Ok | - | - | the build is running |
//! | Err | "exec next" | [`SpawnError::Exec`] | the exec failed: the build's failure |
//! | Err | a step | [`SpawnError::Setup`] | the child never exec'd: nothing ran |
//! | Err | none | [`SpawnError::Fork`] | fork or std's own child setup failed: nothing ran |
//!
//! # Text file busy
//!
//! Linux refuses to exec a file that any process holds open for writing
//! (`ETXTBSY`). The agent writes store copies itself, and a child that
//! another thread forks while such a descriptor is open holds a copy of it
//! until that child's own exec closes it (close-on-exec). So an exec can be
//! refused for a moment though nothing is wrong with the build. [`spawn`]
//! tries again a few times, waiting 5 ms, then twice as long each time
//! (about 0.3 s in all); a file still busy after that is held open by
//! something else on the host: [`SpawnError::ExecBusy`], not the build's
//! failure.
//!
//! The spawn uses std's `Command`, not tokio's: std's spawn returns Ok
//! exactly when the exec succeeded, while tokio's may return an error after
//! a successful exec (registering the child with its reaper), which would
//! read as an exec failure while the build runs. The exit is awaited through
//! a pidfd registered with tokio ([`Spawned::wait`]), with SIGCHLD as the
//! fallback where pidfds are unavailable.

use std::ffi::CString;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::unistd::{Gid, Uid, getegid, geteuid};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::cgroup::Cgroup;

/// The `PATH` a generation gets unless its spec sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The generation's own socket path.
pub const ENV_SOCKET: &str = "GENSWAP_SOCKET";
/// The generation number N.
pub const ENV_GENERATION: &str = "GENSWAP_GENERATION";
/// The build id.
pub const ENV_BUILD: &str = "GENSWAP_BUILD";

/// The status byte the hook writes once every setup step passed.
const EXEC_NEXT: u8 = b'x';
/// After [`EXEC_NEXT`]: the child's own exec failed; its errno follows
/// (four bytes, little-endian).
const EXEC_FAILED: u8 = b'e';

/// Socket activation (`sd_listen_fds(3)`): how many fds from 3 are passed.
pub const ENV_LISTEN_FDS: &str = "LISTEN_FDS";
/// Socket activation: the pid they are for, the generation's own.
pub const ENV_LISTEN_PID: &str = "LISTEN_PID";
/// Socket activation: their names, `:`-separated, in fd order.
pub const ENV_LISTEN_FDNAMES: &str = "LISTEN_FDNAMES";

/// The first fd of the sockets handed over by socket activation.
const LISTEN_FDS_START: i32 = 3;

/// Descriptors the child uses during setup are moved at least this high
/// when sockets are handed over, so that placing those at 3.. cannot
/// overwrite them.
const SETUP_FD_FLOOR: i32 = 100;

/// Where a generation's stdout or stderr goes.
#[derive(Clone, Debug, Default)]
pub enum Output {
    /// The agent's own stream (tests only: an instance must never share
    /// the agent's output, SPEC 5.11).
    #[default]
    Inherit,
    /// Discarded.
    Null,
    /// Appended to this file, created (mode 0640) when missing.
    Append(PathBuf),
    /// This descriptor, such as the write end of a log shim's pipe.
    Fd(std::sync::Arc<OwnedFd>),
}

/// What to start, as whom, and where.
#[derive(Clone, Debug)]
pub struct SpawnSpec {
    /// Absolute path of the executable: the agent's verified store copy.
    pub exe: PathBuf,
    /// Arguments after the executable.
    pub args: Vec<String>,
    /// The environment, on top of an empty one. `GENSWAP_*` names are
    /// replaced by the three values below; `PATH` defaults to
    /// [`DEFAULT_PATH`].
    pub env: Vec<(String, String)>,
    /// Working directory (entered after dropping privileges, so the
    /// instance's user must be able to enter it). `None` keeps the agent's.
    pub working_dir: Option<PathBuf>,
    /// Numeric uid; `None` keeps the agent's.
    pub uid: Option<u32>,
    /// Numeric gid (also the only supplementary group); `None` keeps the
    /// agent's.
    pub gid: Option<u32>,
    /// Allow the process to run with uid or gid 0 (given or inherited).
    pub allow_root: bool,
    /// The generation cgroup, fresh, from
    /// [`InstanceCgroup::create_generation`](crate::cgroup::InstanceCgroup::create_generation).
    pub cgroup: Cgroup,
    /// `GENSWAP_SOCKET`.
    pub socket: PathBuf,
    /// `GENSWAP_GENERATION`.
    pub generation: u64,
    /// `GENSWAP_BUILD`.
    pub build: String,
    /// Where stdout goes.
    pub stdout: Output,
    /// Where stderr goes.
    pub stderr: Output,
    /// Listening sockets handed over by socket activation, in fd order from
    /// 3 (SPEC 6.2).
    pub listeners: Vec<ActivatedSocket>,
}

/// A listening socket a generation receives at exec.
#[derive(Clone, Debug)]
pub struct ActivatedSocket {
    /// Its name in `LISTEN_FDNAMES`.
    pub name: String,
    /// The agent's descriptor of it; the child gets a copy.
    pub fd: std::sync::Arc<OwnedFd>,
}

impl SpawnSpec {
    /// A spec with no arguments, no extra environment, the agent's working
    /// directory and ids, root refused, and inherited output.
    pub fn new(
        exe: impl Into<PathBuf>,
        cgroup: Cgroup,
        socket: impl Into<PathBuf>,
        generation: u64,
        build: impl Into<String>,
    ) -> SpawnSpec {
        SpawnSpec {
            exe: exe.into(),
            args: Vec::new(),
            env: Vec::new(),
            working_dir: None,
            uid: None,
            gid: None,
            allow_root: false,
            cgroup,
            socket: socket.into(),
            generation,
            build: build.into(),
            stdout: Output::Inherit,
            stderr: Output::Inherit,
            listeners: Vec::new(),
        }
    }
}

/// A step the child takes between fork and exec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetupStep {
    /// Writing its pid to the generation's `cgroup.procs`.
    JoinCgroup,
    /// `setsid`.
    NewSession,
    /// `prctl(PR_SET_NO_NEW_PRIVS)`.
    NoNewPrivs,
    /// `setgroups([gid])`.
    Groups,
    /// `setgid`.
    Gid,
    /// `setuid`.
    Uid,
    /// `chdir` to the working directory.
    WorkingDir,
    /// Placing the handed-over sockets at fds 3...
    ListenFds,
}

impl SetupStep {
    const ALL: [SetupStep; 8] = [
        SetupStep::JoinCgroup,
        SetupStep::NewSession,
        SetupStep::NoNewPrivs,
        SetupStep::Groups,
        SetupStep::Gid,
        SetupStep::Uid,
        SetupStep::WorkingDir,
        SetupStep::ListenFds,
    ];

    fn code(self) -> u8 {
        match self {
            SetupStep::JoinCgroup => b'c',
            SetupStep::NewSession => b's',
            SetupStep::NoNewPrivs => b'n',
            SetupStep::Groups => b'G',
            SetupStep::Gid => b'g',
            SetupStep::Uid => b'u',
            SetupStep::WorkingDir => b'w',
            SetupStep::ListenFds => b'l',
        }
    }

    fn from_code(code: u8) -> Option<SetupStep> {
        SetupStep::ALL.into_iter().find(|step| step.code() == code)
    }
}

impl fmt::Display for SetupStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SetupStep::JoinCgroup => "join its generation cgroup",
            SetupStep::NewSession => "start a new session",
            SetupStep::NoNewPrivs => "set no_new_privs",
            SetupStep::Groups => "set its supplementary groups",
            SetupStep::Gid => "set its gid",
            SetupStep::Uid => "set its uid",
            SetupStep::WorkingDir => "enter its working directory",
            SetupStep::ListenFds => "place its listening sockets at fds 3..",
        })
    }
}

/// Why a generation did not start, or its exit could not be awaited.
///
/// For the classifier: [`is_refusal`](Self::is_refusal) errors prove that
/// nothing of the build ran and are the host's or the configuration's
/// (stale, `executed: false`); [`SpawnError::Exec`] is the build's own
/// failure (failed), and nothing of it ran either; [`SpawnError::Wait`]
/// comes after a successful start.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// uid or gid 0 without `allow_root`. Checked before anything is
    /// opened or forked.
    #[error(
        "refusing to start generation {generation} as {who}: the agent does not allow root instances"
    )]
    RootRefused {
        generation: u64,
        /// Which id is 0 and where it came from.
        who: String,
    },
    /// The spec cannot be executed as given (relative exe, NUL bytes, an
    /// env name with `=`). Checked before anything is opened or forked.
    #[error("invalid spawn spec for generation {generation}: {reason}")]
    InvalidSpec { generation: u64, reason: String },
    /// The generation's `cgroup.procs` could not be opened: the child could
    /// not have joined its cgroup, so no fork happened.
    #[error("cannot open {path} to place generation {generation} in its cgroup: {source}")]
    OpenCgroup {
        generation: u64,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Something the parent prepares before the fork failed (the status
    /// pipe, an output file).
    #[error("cannot {what} for generation {generation}: {source}")]
    Prepare {
        generation: u64,
        what: String,
        #[source]
        source: io::Error,
    },
    /// The fork, or std's own child setup before the hook (stdio), failed.
    #[error("cannot start generation {generation}: fork or stdio setup failed: {source}")]
    Fork {
        generation: u64,
        #[source]
        source: io::Error,
    },
    /// The child failed a setup step and exited without exec.
    #[error(
        "generation {generation} did not start: the child could not {step} ({source}); nothing of the build ran"
    )]
    Setup {
        generation: u64,
        step: SetupStep,
        #[source]
        source: io::Error,
    },
    /// The exec of the build failed (missing, not executable, bad format).
    #[error("exec of {} for generation {generation} failed: {source}", exe.display())]
    Exec {
        generation: u64,
        exe: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The build is a `#!` script whose interpreter does not exist: the
    /// kernel's `ENOENT` names the script, which does exist.
    #[error(
        "exec of {} for generation {generation} failed: interpreter {} named on its #! line does not exist",
        exe.display(),
        interpreter.display()
    )]
    MissingInterpreter {
        generation: u64,
        exe: PathBuf,
        interpreter: PathBuf,
    },
    /// The exec was refused with `ETXTBSY` on every try: some process
    /// holds the file open for writing. Nothing of the build ran, and the
    /// build is not to blame.
    #[error(
        "exec of {} for generation {generation} refused {tries} times: the file is open for writing elsewhere ({source})",
        exe.display()
    )]
    ExecBusy {
        generation: u64,
        exe: PathBuf,
        tries: u32,
        #[source]
        source: io::Error,
    },
    /// Waiting for the running process failed.
    #[error("waiting for pid {pid} of generation {generation} failed: {source}")]
    Wait {
        generation: u64,
        pid: u32,
        #[source]
        source: io::Error,
    },
}

impl SpawnError {
    /// Nothing of the build ran and the cause is not the build: every
    /// variant but `Exec` and `Wait` (`ExecBusy` included). Stale.
    pub fn is_refusal(&self) -> bool {
        !matches!(
            self,
            SpawnError::Exec { .. }
                | SpawnError::MissingInterpreter { .. }
                | SpawnError::Wait { .. }
        )
    }

    /// The build's own failure: its exec failed.
    pub fn is_build_failure(&self) -> bool {
        matches!(
            self,
            SpawnError::Exec { .. } | SpawnError::MissingInterpreter { .. }
        )
    }

    /// A process of the build may have run: only after a successful start
    /// (`Wait`). Every other variant proves the build's code never ran.
    pub fn may_have_run(&self) -> bool {
        matches!(self, SpawnError::Wait { .. })
    }
}

/// What the kernel says a started process is, read from `/proc/<pid>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// `/proc/<pid>/exe`.
    pub exe: PathBuf,
    /// Its cgroup v2 path from `/proc/<pid>/cgroup` (the `0::` line).
    pub cgroup: String,
    /// `GENSWAP_GENERATION` from `/proc/<pid>/environ`.
    pub generation: Option<String>,
    /// `GENSWAP_BUILD` from `/proc/<pid>/environ`.
    pub build: Option<String>,
    /// `GENSWAP_SOCKET` from `/proc/<pid>/environ`.
    pub socket: Option<String>,
}

/// The started process is not what the spec asked for, or cannot be
/// inspected.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// `/proc/<pid>` could not be read: the process has most likely exited
    /// already.
    #[error("pid {pid} cannot be inspected ({}): {source}", path.display())]
    Unreadable {
        pid: u32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// One property differs from the spec.
    #[error(
        "pid {pid} has {what} {found:?}, but generation {generation} was started with {expected:?}"
    )]
    Mismatch {
        pid: u32,
        generation: u64,
        what: &'static str,
        expected: String,
        found: String,
    },
}

/// A started generation's main process. Reaped when it exits, also when
/// this handle is dropped first (it is not killed then: stop it through
/// its cgroup).
#[derive(Debug)]
pub struct Spawned {
    exit: ExitWatch,
    pid: u32,
    exe: PathBuf,
    resolved_exe: Option<PathBuf>,
    /// The interpreter named on the build's `#!` line, when the build is a
    /// script.
    interpreter: Option<PathBuf>,
    generation: u64,
    build: String,
    socket: PathBuf,
    cgroup: Cgroup,
}

impl Spawned {
    /// The main process's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The generation number passed as `GENSWAP_GENERATION`.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The build id passed as `GENSWAP_BUILD`.
    pub fn build(&self) -> &str {
        &self.build
    }

    /// The executable that was exec'd (as given in the spec).
    pub fn exe(&self) -> &Path {
        &self.exe
    }

    /// The socket path passed as `GENSWAP_SOCKET`.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The generation cgroup it was placed in.
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Reads what the kernel says the process is.
    pub fn observe(&self) -> Result<Observed, VerifyError> {
        observe(self.pid)
    }

    /// Checks that the running process is exactly what was started: the
    /// executable (symlinks resolved), the cgroup (when its handle knows its
    /// `/proc` path), and the three `GENSWAP_*` values. Returns what it
    /// observed.
    pub fn verify(&self) -> Result<Observed, VerifyError> {
        let observed = self.observe()?;
        // A `#!` script runs as its interpreter (reading the store file),
        // and a wrapper may already have exec'd what it starts: neither is
        // the store file, and only the script itself can have exec'd, so
        // for a script the cgroup and environment below are the proof.
        if self.interpreter.is_none() {
            let expected_exe = self.resolved_exe.as_deref().unwrap_or(&self.exe);
            self.expect(
                "executable",
                &expected_exe.display().to_string(),
                &observed.exe.display().to_string(),
            )?;
        }
        if let Some(cgroup) = self.cgroup.proc_path() {
            self.expect("cgroup", cgroup, &observed.cgroup)?;
        }
        let unset = || "<unset>".to_owned();
        self.expect(
            ENV_GENERATION,
            &self.generation.to_string(),
            &observed.generation.clone().unwrap_or_else(unset),
        )?;
        self.expect(
            ENV_BUILD,
            &self.build,
            &observed.build.clone().unwrap_or_else(unset),
        )?;
        self.expect(
            ENV_SOCKET,
            &self.socket.display().to_string(),
            &observed.socket.clone().unwrap_or_else(unset),
        )?;
        Ok(observed)
    }

    fn expect(&self, what: &'static str, expected: &str, found: &str) -> Result<(), VerifyError> {
        if expected == found {
            return Ok(());
        }
        Err(VerifyError::Mismatch {
            pid: self.pid,
            generation: self.generation,
            what,
            expected: expected.to_owned(),
            found: found.to_owned(),
        })
    }

    /// Waits for the main process to exit and returns its status (cached:
    /// later calls return it again). Cancel-safe.
    pub async fn wait(&mut self) -> Result<ExitStatus, SpawnError> {
        self.exit.wait().await.map_err(|source| SpawnError::Wait {
            generation: self.generation,
            pid: self.pid,
            source,
        })
    }

    /// The exit status if the main process has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>, SpawnError> {
        self.exit.try_wait().map_err(|source| SpawnError::Wait {
            generation: self.generation,
            pid: self.pid,
            source,
        })
    }
}

/// How many times an exec refused with `ETXTBSY` is tried in all.
pub const EXEC_BUSY_TRIES: u32 = 7;

/// The wait before the second try; it doubles before each further one.
const EXEC_BUSY_FIRST_WAIT: Duration = Duration::from_millis(5);

/// Starts the generation described by `spec`. Must be called inside a
/// tokio runtime (the exit is awaited through it). See the module docs for
/// the order of steps, how errors classify, and the retry of a busy file.
pub async fn spawn(spec: SpawnSpec) -> Result<Spawned, SpawnError> {
    retry_while_busy(|| spawn_once(&spec), tokio::time::sleep).await
}

/// Calls `once` until it returns anything but an exec refused with
/// `ETXTBSY`, [`EXEC_BUSY_TRIES`] times at most, sleeping with `sleep`
/// between tries. A failed exec leaves nothing behind (std reaps the
/// child), so another try starts clean.
async fn retry_while_busy<T, Sleep>(
    mut once: impl FnMut() -> Result<T, SpawnError>,
    sleep: impl Fn(Duration) -> Sleep,
) -> Result<T, SpawnError>
where
    Sleep: std::future::Future<Output = ()>,
{
    let mut wait = EXEC_BUSY_FIRST_WAIT;
    let mut tries = 1;
    loop {
        match once() {
            Err(SpawnError::Exec {
                generation,
                exe,
                source,
            }) if source.raw_os_error() == Some(Errno::ETXTBSY as i32) => {
                if tries == EXEC_BUSY_TRIES {
                    return Err(SpawnError::ExecBusy {
                        generation,
                        exe,
                        tries,
                        source,
                    });
                }
                sleep(wait).await;
                wait *= 2;
                tries += 1;
            }
            other => return other,
        }
    }
}

fn spawn_once(spec: &SpawnSpec) -> Result<Spawned, SpawnError> {
    let generation = spec.generation;
    check_root(spec)?;
    let plan = Plan::new(spec)?;

    let procs_path = spec.cgroup.procs_file();
    let procs: OwnedFd = OpenOptions::new()
        .write(true)
        .open(&procs_path)
        .map_err(|source| SpawnError::OpenCgroup {
            generation,
            path: procs_path.clone(),
            source,
        })?
        .into();
    let (status_read, status_write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| SpawnError::Prepare {
            generation,
            what: "create the status pipe".to_owned(),
            source: e.into(),
        })?;
    let stdout = stdio_for(&spec.stdout, generation)?;
    let stderr = stdio_for(&spec.stderr, generation)?;
    let prepare = |what: &str, source: io::Error| SpawnError::Prepare {
        generation,
        what: what.to_owned(),
        source,
    };
    let (procs, status_write, activation) = if spec.listeners.is_empty() {
        (procs, status_write, None)
    } else {
        let high = |fd: &OwnedFd| -> io::Result<OwnedFd> {
            let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(SETUP_FD_FLOOR))?;
            // SAFETY: fcntl just returned this new descriptor; nothing else owns it.
            Ok(unsafe { OwnedFd::from_raw_fd(raw) })
        };
        let sources = spec
            .listeners
            .iter()
            .map(|listener| high(&listener.fd))
            .collect::<io::Result<Vec<_>>>()
            .map_err(|e| prepare("copy the listening sockets", e))?;
        let image = ExecImage::new(&spec.exe, &spec.args, &plan.env)
            .map_err(|e| prepare("prepare the exec", e))?;
        let moved = (
            high(&procs).map_err(|e| prepare("move cgroup.procs", e))?,
            high(&status_write).map_err(|e| prepare("move the status pipe", e))?,
            Some(Activation { sources, image }),
        );
        // Closed now: a write end of the status pipe left open here would
        // keep its reader waiting for an end-of-file that never comes.
        drop((procs, status_write));
        moved
    };

    let mut command = std::process::Command::new(&spec.exe);
    command
        .args(&spec.args)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr);
    let setup = ChildSetup {
        procs,
        status: status_write,
        gid: plan.gid,
        uid: plan.uid,
        working_dir: plan.working_dir,
        activation,
    };
    // SAFETY: the hook runs in the forked child of a possibly
    // multi-threaded parent, where only async-signal-safe calls are
    // allowed. `ChildSetup::run` makes only raw system calls (write,
    // setsid, prctl, setgroups, setgid, setuid, chdir, dup2, getpid,
    // execve) on values prepared before the fork (descriptors, ids,
    // CStrings, pointer arrays); it neither allocates nor takes locks. Its
    // errors are `io::Error::from_raw_os_error`, which does not allocate.
    unsafe {
        command.pre_exec(move || setup.run());
    }
    let started = command.spawn();
    // Drops the hook, closing the parent's copies of the status pipe's
    // write end and of cgroup.procs, so the read below sees end-of-file.
    drop(command);
    let (reported, exec_failed) = read_status(&status_read);
    // The child's own exec (socket activation) failed after it had placed
    // the sockets over whatever it held at 3.., std's error pipe included:
    // std may then have seen a successful spawn. The errno came through the
    // status pipe; the child exits at once.
    let started = match (started, exec_failed) {
        (Ok(mut child), Some(errno)) => {
            let _ = child.wait();
            Err(io::Error::from(errno))
        }
        (started, _) => started,
    };

    let child = match started {
        Ok(child) => child,
        Err(source) => {
            return Err(match reported {
                Some(EXEC_NEXT) => match missing_interpreter(&spec.exe, &source) {
                    Some(interpreter) => SpawnError::MissingInterpreter {
                        generation,
                        exe: spec.exe.clone(),
                        interpreter,
                    },
                    None => SpawnError::Exec {
                        generation,
                        exe: spec.exe.clone(),
                        source,
                    },
                },
                Some(code) => match SetupStep::from_code(code) {
                    Some(step) => SpawnError::Setup {
                        generation,
                        step,
                        source,
                    },
                    None => SpawnError::Fork { generation, source },
                },
                None => SpawnError::Fork { generation, source },
            });
        }
    };
    let pid = child.id();
    Ok(Spawned {
        exit: ExitWatch::new(child),
        pid,
        resolved_exe: std::fs::canonicalize(&spec.exe).ok(),
        interpreter: script_interpreter(&spec.exe),
        exe: spec.exe.clone(),
        generation,
        build: spec.build.clone(),
        socket: spec.socket.clone(),
        cgroup: spec.cgroup.clone(),
    })
}

/// The interpreter on `exe`'s `#!` line (the first word after it, as the
/// kernel reads it), when `exe` is a script.
pub fn script_interpreter(exe: &Path) -> Option<PathBuf> {
    use std::io::Read;
    let mut head = [0u8; 256];
    let mut file = std::fs::File::open(exe).ok()?;
    let read = file.read(&mut head).ok()?;
    let line = head[..read].strip_prefix(b"#!")?;
    let line = line.split(|b| *b == b'\n').next()?;
    let word = line
        .split(|b| *b == b' ' || *b == b'\t')
        .find(|word| !word.is_empty())?;
    use std::os::unix::ffi::OsStrExt;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(word)))
}

/// The interpreter that made an exec fail with `ENOENT` although `exe`
/// exists: a script naming one that does not.
fn missing_interpreter(exe: &Path, error: &io::Error) -> Option<PathBuf> {
    if error.raw_os_error() != Some(Errno::ENOENT as i32) || !exe.exists() {
        return None;
    }
    script_interpreter(exe).filter(|interpreter| !interpreter.exists())
}

fn check_root(spec: &SpawnSpec) -> Result<(), SpawnError> {
    if spec.allow_root {
        return Ok(());
    }
    let who = match (spec.uid, spec.gid) {
        (Some(0), _) => Some("uid 0".to_owned()),
        (None, _) if geteuid().is_root() => {
            Some("uid 0 (no user is set, so it would inherit the agent's)".to_owned())
        }
        (_, Some(0)) => Some("gid 0".to_owned()),
        (_, None) if getegid().as_raw() == 0 => {
            Some("gid 0 (no group is set, so it would inherit the agent's)".to_owned())
        }
        _ => None,
    };
    match who {
        Some(who) => Err(SpawnError::RootRefused {
            generation: spec.generation,
            who,
        }),
        None => Ok(()),
    }
}

/// Everything computed from the spec before the fork.
struct Plan {
    env: Vec<(String, String)>,
    uid: Option<Uid>,
    gid: Option<Gid>,
    working_dir: Option<CString>,
}

impl Plan {
    fn new(spec: &SpawnSpec) -> Result<Plan, SpawnError> {
        let invalid = |reason: String| SpawnError::InvalidSpec {
            generation: spec.generation,
            reason,
        };
        if !spec.exe.is_absolute() {
            return Err(invalid(format!(
                "the executable {} is not an absolute path",
                spec.exe.display()
            )));
        }
        let has_nul = |s: &[u8]| s.contains(&0);
        if has_nul(spec.exe.as_os_str().as_bytes())
            || spec.args.iter().any(|a| has_nul(a.as_bytes()))
        {
            return Err(invalid(
                "the executable or an argument contains a NUL byte".to_owned(),
            ));
        }
        let mut env: Vec<(String, String)> = Vec::with_capacity(spec.env.len() + 4);
        for (name, value) in &spec.env {
            if name.is_empty()
                || name.contains('=')
                || has_nul(name.as_bytes())
                || has_nul(value.as_bytes())
            {
                return Err(invalid(format!(
                    "invalid environment variable name or value for {name:?}"
                )));
            }
            if [
                ENV_SOCKET,
                ENV_GENERATION,
                ENV_BUILD,
                ENV_LISTEN_FDS,
                ENV_LISTEN_PID,
                ENV_LISTEN_FDNAMES,
            ]
            .contains(&name.as_str())
            {
                continue;
            }
            env.push((name.clone(), value.clone()));
        }
        if !env.iter().any(|(name, _)| name == "PATH") {
            env.push(("PATH".to_owned(), DEFAULT_PATH.to_owned()));
        }
        let socket = spec
            .socket
            .to_str()
            .ok_or_else(|| invalid("the socket path is not UTF-8".to_owned()))?;
        if has_nul(socket.as_bytes()) || has_nul(spec.build.as_bytes()) {
            return Err(invalid(
                "the socket path or build id contains a NUL byte".to_owned(),
            ));
        }
        env.push((ENV_SOCKET.to_owned(), socket.to_owned()));
        env.push((ENV_GENERATION.to_owned(), spec.generation.to_string()));
        env.push((ENV_BUILD.to_owned(), spec.build.clone()));
        if !spec.listeners.is_empty() {
            if spec
                .listeners
                .iter()
                .any(|l| l.name.is_empty() || l.name.contains([':', '\0']))
            {
                return Err(invalid(
                    "a listener name is empty or contains ':' or NUL".to_owned(),
                ));
            }
            env.push((ENV_LISTEN_FDS.to_owned(), spec.listeners.len().to_string()));
            let names: Vec<&str> = spec.listeners.iter().map(|l| l.name.as_str()).collect();
            env.push((ENV_LISTEN_FDNAMES.to_owned(), names.join(":")));
        }

        let working_dir = spec
            .working_dir
            .as_ref()
            .map(|dir| CString::new(dir.as_os_str().as_bytes()))
            .transpose()
            .map_err(|_| invalid("the working directory contains a NUL byte".to_owned()))?;
        // Changing the uid drops the agent's supplementary groups too, so a
        // group is always set along with a user.
        let gid = spec
            .gid
            .map(Gid::from_raw)
            .or_else(|| spec.uid.map(|_| getegid()));
        Ok(Plan {
            env,
            uid: spec.uid.map(Uid::from_raw),
            gid,
            working_dir,
        })
    }
}

fn stdio_for(output: &Output, generation: u64) -> Result<Stdio, SpawnError> {
    match output {
        Output::Inherit => Ok(Stdio::inherit()),
        Output::Null => Ok(Stdio::null()),
        Output::Fd(fd) => fd
            .try_clone()
            .map(Stdio::from)
            .map_err(|source| SpawnError::Prepare {
                generation,
                what: "duplicate the output descriptor".into(),
                source,
            }),
        Output::Append(path) => OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .open(path)
            .map(Stdio::from)
            .map_err(|source| SpawnError::Prepare {
                generation,
                what: format!("open the output file {}", path.display()),
                source,
            }),
    }
}

/// The first byte the hook reported, or `None` at end-of-file (the hook
/// never ran or never reached a report).
/// The child's status bytes, read to end-of-file (its exec or exit closes
/// the pipe): the step byte, and the errno of an exec the child made itself
/// and saw fail.
fn read_status(status: &OwnedFd) -> (Option<u8>, Option<Errno>) {
    let mut bytes = [0u8; 6];
    let mut len = 0;
    while len < bytes.len() {
        match nix::unistd::read(status, &mut bytes[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    let step = (len > 0).then_some(bytes[0]);
    let exec_failed = (len == 6 && bytes[1] == EXEC_FAILED)
        .then(|| Errno::from_raw(i32::from_le_bytes([bytes[2], bytes[3], bytes[4], bytes[5]])));
    (step, exec_failed)
}

/// What the child does between fork and exec.
struct ChildSetup {
    procs: OwnedFd,
    status: OwnedFd,
    gid: Option<Gid>,
    uid: Option<Uid>,
    working_dir: Option<CString>,
    activation: Option<Activation>,
}

/// Socket activation's share of the child's setup: the sockets (copies at
/// [`SETUP_FD_FLOOR`] or above) to place at fds 3.., and the exec the child
/// makes itself, since `LISTEN_PID` must be its own pid, which only it
/// knows, and std's exec takes an environment fixed before the fork.
struct Activation {
    sources: Vec<OwnedFd>,
    image: ExecImage,
}

/// `execve`'s arguments, built before the fork, with room in the
/// environment for the child to write its pid into.
struct ExecImage {
    path: CString,
    _strings: Vec<CString>,
    argv: Vec<*const nix::libc::c_char>,
    envp: Vec<*const nix::libc::c_char>,
    /// `LISTEN_PID=` and room for the digits and their NUL.
    pid_entry: Box<[u8; PID_ENTRY_LEN]>,
}

/// `LISTEN_PID=` (11 bytes), up to 20 digits, NUL.
const PID_ENTRY_LEN: usize = 32;

// SAFETY: the raw pointers point into buffers the image owns (`_strings`'
// and `pid_entry`'s heap allocations, which never move); only the forked
// child reads them or writes the pid digits, and the parent drops the
// image without touching them.
unsafe impl Send for ExecImage {}
// SAFETY: as for Send: no thread of the parent dereferences the pointers.
unsafe impl Sync for ExecImage {}

impl ExecImage {
    fn new(exe: &Path, args: &[String], env: &[(String, String)]) -> io::Result<ExecImage> {
        let nul = |_| io::Error::from(io::ErrorKind::InvalidInput);
        let path = CString::new(exe.as_os_str().as_bytes()).map_err(nul)?;
        let mut strings = Vec::with_capacity(1 + args.len() + env.len());
        strings.push(path.clone());
        for arg in args {
            strings.push(CString::new(arg.as_str()).map_err(nul)?);
        }
        let argc = strings.len();
        for (name, value) in env {
            strings.push(CString::new(format!("{name}={value}")).map_err(nul)?);
        }
        let mut pid_entry = Box::new([0u8; PID_ENTRY_LEN]);
        let prefix = format!("{ENV_LISTEN_PID}=");
        pid_entry[..prefix.len()].copy_from_slice(prefix.as_bytes());
        let mut argv: Vec<*const nix::libc::c_char> =
            strings[..argc].iter().map(|s| s.as_ptr()).collect();
        argv.push(std::ptr::null());
        let mut envp: Vec<*const nix::libc::c_char> =
            strings[argc..].iter().map(|s| s.as_ptr()).collect();
        envp.push(pid_entry.as_ptr().cast());
        envp.push(std::ptr::null());
        Ok(ExecImage {
            path,
            _strings: strings,
            argv,
            envp,
            pid_entry,
        })
    }

    /// In the child: writes its pid into `LISTEN_PID` and execs. Returns
    /// only if the exec failed.
    fn exec(&self) -> Errno {
        let start = ENV_LISTEN_PID.len() + 1;
        let mut digits = [0u8; 20];
        let mut pid = nix::unistd::getpid().as_raw().unsigned_abs();
        let mut len = 0;
        loop {
            digits[len] = b'0' + (pid % 10) as u8;
            len += 1;
            pid /= 10;
            if pid == 0 {
                break;
            }
        }
        let entry = self.pid_entry.as_ptr().cast_mut();
        for (i, digit) in digits[..len].iter().rev().enumerate() {
            // SAFETY: start + len + 1 <= PID_ENTRY_LEN; the child owns its
            // copy of the buffer, and nothing else reads it until execve.
            unsafe { entry.add(start + i).write(*digit) };
        }
        // SAFETY: as above; the NUL ends the entry after the digits.
        unsafe { entry.add(start + len).write(0) };
        // SAFETY: path, argv and envp are NUL-terminated strings and
        // null-terminated pointer arrays built before the fork and alive
        // as long as `self`.
        unsafe { nix::libc::execve(self.path.as_ptr(), self.argv.as_ptr(), self.envp.as_ptr()) };
        Errno::last()
    }
}

impl ChildSetup {
    /// Runs in the forked child: async-signal-safe calls only.
    fn run(&self) -> io::Result<()> {
        // Placement first, while still root: the build's first instruction
        // must run in its cgroup.
        self.step(SetupStep::JoinCgroup, || {
            nix::unistd::write(&self.procs, b"0").map(drop)
        })?;
        // Out of the agent's session, so a terminal's signals to the agent
        // do not reach instances.
        self.step(SetupStep::NewSession, || nix::unistd::setsid().map(drop))?;
        self.step(SetupStep::NoNewPrivs, nix::sys::prctl::set_no_new_privs)?;
        if let Some(gid) = self.gid {
            self.step(SetupStep::Groups, || nix::unistd::setgroups(&[gid]))?;
            self.step(SetupStep::Gid, || nix::unistd::setgid(gid))?;
        }
        if let Some(uid) = self.uid {
            self.step(SetupStep::Uid, || nix::unistd::setuid(uid))?;
        }
        if let Some(dir) = &self.working_dir {
            self.step(SetupStep::WorkingDir, || nix::unistd::chdir(dir.as_c_str()))?;
        }
        if let Some(activation) = &self.activation {
            self.step(SetupStep::ListenFds, || {
                for (offset, source) in (LISTEN_FDS_START..).zip(&activation.sources) {
                    // SAFETY: dup2 onto 3.. in the child, whose setup
                    // descriptors all lie at SETUP_FD_FLOOR or above; the
                    // copy it makes is not close-on-exec, as the protocol
                    // wants.
                    if unsafe { nix::libc::dup2(source.as_raw_fd(), offset) } < 0 {
                        return Err(Errno::last());
                    }
                }
                Ok(())
            })?;
        }
        // From here on a failure is the exec's.
        nix::unistd::write(&self.status, &[EXEC_NEXT])
            .map(drop)
            .map_err(|errno| io::Error::from_raw_os_error(errno as i32))?;
        match &self.activation {
            Some(activation) => {
                let errno = activation.image.exec() as i32;
                let [a, b, c, d] = errno.to_le_bytes();
                let _ = nix::unistd::write(&self.status, &[EXEC_FAILED, a, b, c, d]);
                Err(io::Error::from_raw_os_error(errno))
            }
            None => Ok(()),
        }
    }

    fn step(&self, step: SetupStep, call: impl FnOnce() -> nix::Result<()>) -> io::Result<()> {
        call().map_err(|errno| {
            // Best effort: without the byte the parent still knows the
            // exec did not happen (it reads "fork failed").
            let _ = nix::unistd::write(&self.status, &[step.code()]);
            io::Error::from_raw_os_error(errno as i32)
        })
    }
}

/// The main process and a way to await its exit without a thread.
#[derive(Debug)]
struct ExitWatch {
    child: Option<std::process::Child>,
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
    fn new(child: std::process::Child) -> ExitWatch {
        let waker = match pidfd_open(child.id()) {
            Ok(fd) => {
                // SAFETY: an OwnedFd is a valid open descriptor that stays
                // open, and names the same description, until the AsyncFd
                // that owns it drops.
                match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
                    Ok(fd) => ExitWaker::Pidfd(fd),
                    Err(_) => sigchld_waker(),
                }
            }
            Err(_) => sigchld_waker(),
        };
        ExitWatch {
            child: Some(child),
            waker,
            status: None,
            orphan: false,
        }
    }

    fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.status.is_some() {
            return Ok(self.status);
        }
        let Some(child) = self.child.as_mut() else {
            return Ok(None);
        };
        self.status = child.try_wait()?;
        Ok(self.status)
    }

    async fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            match &mut self.waker {
                ExitWaker::Pidfd(fd) => {
                    let mut guard = fd.readable().await?;
                    let exited = match self.child.as_mut() {
                        Some(child) => child.try_wait()?,
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
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(_)) = child.try_wait() {
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
                    child: Some(child),
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
                std::thread::spawn(move || child.wait());
            }
        }
    }
}

/// Reaps `child` once it exits, in the background: through a pidfd awaited
/// by a task where a runtime runs (no thread held for its whole life), else
/// on a thread.
pub(crate) fn reap_when_exited(child: std::process::Child) {
    drop(ExitWatch::new(child));
}

fn sigchld_waker() -> ExitWaker {
    ExitWaker::Sigchld(tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok())
}

pub(crate) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = nix::libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // (close-on-exec) or -1; no memory is passed.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: the kernel just returned this descriptor and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn observe(pid: u32) -> Result<Observed, VerifyError> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let unreadable =
        |path: PathBuf| move |source: io::Error| VerifyError::Unreadable { pid, path, source };
    let exe_path = proc.join("exe");
    let exe = std::fs::read_link(&exe_path).map_err(unreadable(exe_path.clone()))?;
    let cgroup_path = proc.join("cgroup");
    let cgroups = std::fs::read_to_string(&cgroup_path).map_err(unreadable(cgroup_path.clone()))?;
    let cgroup = cgroups
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .unwrap_or_default()
        .to_owned();
    let environ_path = proc.join("environ");
    let environ = read_bytes(&environ_path).map_err(unreadable(environ_path.clone()))?;
    let lookup = |name: &str| {
        environ.split(|b| *b == 0).find_map(|entry| {
            let rest = entry.strip_prefix(name.as_bytes())?.strip_prefix(b"=")?;
            Some(String::from_utf8_lossy(rest).into_owned())
        })
    };
    Ok(Observed {
        exe,
        cgroup,
        generation: lookup(ENV_GENERATION),
        build: lookup(ENV_BUILD),
        socket: lookup(ENV_SOCKET),
    })
}

fn read_bytes(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(generation: u64) -> SpawnError {
        SpawnError::Exec {
            generation,
            exe: "/store/sha256-ab".into(),
            source: io::Error::from_raw_os_error(Errno::ETXTBSY as i32),
        }
    }

    /// Runs [`retry_while_busy`] over `results` (one per try; a busy exec
    /// of generation 2 once they run out), recording each wait; returns the
    /// result, the number of tries and the waits.
    fn retried(
        results: Vec<Result<u64, SpawnError>>,
    ) -> (Result<u64, SpawnError>, u32, Vec<Duration>) {
        let mut results = results.into_iter();
        let mut tries = 0;
        let waits = std::cell::RefCell::new(Vec::new());
        let result = futures::executor::block_on(retry_while_busy(
            || {
                tries += 1;
                results.next().unwrap_or_else(|| Err(busy(2)))
            },
            |wait| {
                waits.borrow_mut().push(wait);
                std::future::ready(())
            },
        ));
        (result, tries, waits.into_inner())
    }

    #[test]
    fn a_busy_exec_is_tried_again_until_it_starts() {
        let (result, tries, waits) = retried(vec![Err(busy(2)), Err(busy(2)), Ok(7)]);
        assert_eq!(result.ok(), Some(7));
        assert_eq!(tries, 3);
        assert_eq!(waits, [Duration::from_millis(5), Duration::from_millis(10)]);
    }

    #[test]
    fn a_file_busy_on_every_try_is_exec_busy_not_the_builds_failure() {
        let (result, tries, waits) = retried(vec![Err(busy(2))]);
        let error = result.expect_err("busy every time");
        assert!(
            matches!(
                error,
                SpawnError::ExecBusy {
                    generation: 2,
                    tries: EXEC_BUSY_TRIES,
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(error.is_refusal() && !error.is_build_failure(), "{error}");
        assert_eq!(tries, EXEC_BUSY_TRIES);
        assert_eq!(waits.len() as u32, EXEC_BUSY_TRIES - 1);
        let total: Duration = waits.iter().sum();
        assert!(total < Duration::from_secs(1), "{total:?} in all");
    }

    #[test]
    fn other_errors_are_not_tried_again() {
        let not_found = SpawnError::Exec {
            generation: 2,
            exe: "/store/sha256-ab".into(),
            source: io::Error::from_raw_os_error(Errno::ENOENT as i32),
        };
        let (result, tries, waits) = retried(vec![Err(not_found)]);
        assert!(matches!(result, Err(SpawnError::Exec { .. })), "{result:?}");
        assert_eq!((tries, waits.len()), (1, 0));
    }

    #[test]
    fn setup_step_codes_round_trip_and_differ_from_exec_next() {
        for step in SetupStep::ALL {
            assert_eq!(SetupStep::from_code(step.code()), Some(step));
            assert_ne!(step.code(), EXEC_NEXT);
        }
        assert_eq!(SetupStep::from_code(EXEC_NEXT), None);
    }
}
