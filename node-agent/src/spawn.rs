//! Starting a generation inside its fresh cgroup.
//!
//! [`spawn`] forks, and the child, before it executes anything of the build,
//! joins its generation cgroup, starts a new session, takes its sandbox's
//! resource limits, umask and capability bounding set ([`crate::confine`]),
//! sets no_new_privs, drops to the instance's uid/gid (raising the ambient
//! capabilities its spec keeps), changes directory and, last, installs its
//! system call filter; then it execs the
//! store copy of the build with a clean environment (the spec's variables, a
//! minimal `PATH`, and `GENSWAP_SOCKET`, `GENSWAP_GENERATION`,
//! `GENSWAP_BUILD`).
//!
//! # Placement
//!
//! The child is created inside its cgroup by `clone3(CLONE_INTO_CGROUP)`
//! ([`crate::launch`]), so the build's first instruction already runs there
//! and everything it forks stays there; where the kernel refuses that, the
//! forked child writes `0` to `cgroup.procs` before anything else.
//!
//! # Telling "nothing ran" from "the build failed"
//!
//! The child reports over a close-on-exec status pipe: the code of the
//! [`SetupStep`] that failed, or an "exec next" byte once every step
//! passed, then the errno if the exec failed:
//!
//! | report | error | meaning |
//! | --- | --- | --- |
//! | "exec next", then end-of-file | - | the build is running |
//! | "exec next", then an errno | [`SpawnError::Exec`] | the exec failed: the build's failure |
//! | a step | [`SpawnError::Setup`] | the child never exec'd: nothing ran |
//! | nothing | [`SpawnError::Fork`] | no child, or it ended at once: nothing ran |
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
//! The exit is awaited through the pidfd `clone3` returned, registered with
//! tokio ([`Spawned::wait`]), with SIGCHLD as the fallback where pidfds are
//! unavailable.

use std::ffi::CString;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use nix::errno::Errno;
use nix::unistd::{Gid, Uid, getegid, geteuid};

use crate::cgroup::Cgroup;
use crate::launch::{self, ChildStep, ExecImage, Launch, LaunchError, Launched, SETUP_FD_FLOOR};
use crate::process::ExitWatch;

/// The `PATH` a generation gets unless its spec sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The generation's own socket path.
pub const ENV_SOCKET: &str = "GENSWAP_SOCKET";
/// The generation number N.
pub const ENV_GENERATION: &str = "GENSWAP_GENERATION";
/// The build id.
pub const ENV_BUILD: &str = "GENSWAP_BUILD";
/// A sidecar's: the socket of the generation it follows (SPEC 5.13).
pub const ENV_TARGET_SOCKET: &str = "GENSWAP_TARGET_SOCKET";
/// A sidecar's: the main pid of the generation it follows.
pub const ENV_TARGET_PID: &str = "GENSWAP_TARGET_PID";

/// Socket activation (`sd_listen_fds(3)`): how many fds from 3 are passed.
pub const ENV_LISTEN_FDS: &str = "LISTEN_FDS";
/// Socket activation: the pid they are for, the generation's own.
pub const ENV_LISTEN_PID: &str = "LISTEN_PID";
/// Socket activation: their names, `:`-separated, in fd order.
pub const ENV_LISTEN_FDNAMES: &str = "LISTEN_FDNAMES";

/// The first fd of the sockets handed over by socket activation.
const LISTEN_FDS_START: i32 = 3;

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
    /// Its name as the build gives it (`argv[0]`); `None`: `exe` as run.
    pub argv0: Option<String>,
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
    /// `Some(pid)` starts a sidecar of the generation whose main process
    /// is `pid` (SPEC 5.13): `socket` is passed as `GENSWAP_TARGET_SOCKET`
    /// with `GENSWAP_TARGET_PID`, and no `GENSWAP_SOCKET` is set, so a
    /// program that binds `GENSWAP_SOCKET` never takes its generation's.
    pub target_pid: Option<u32>,
    /// What the process may use (SPEC 5.16): systemd's defaults unless its
    /// spec says otherwise. `None` only for the agent's own helpers (the
    /// listener keeper), which keep the agent's.
    pub sandbox: Option<crate::confine::SandboxSpec>,
    /// Kept readable inside a `Protected` filesystem besides the
    /// executable and the working directory: a tree build's root.
    pub readable: Vec<PathBuf>,
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
            target_pid: None,
            sandbox: Some(crate::confine::SandboxSpec::default()),
            readable: Vec::new(),
            argv0: None,
        }
    }
}

/// A step the child takes between fork and exec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetupStep {
    /// Writing its pid to the generation's `cgroup.procs` (only where the
    /// kernel could not create it there).
    JoinCgroup,
    /// Writing its pid to the v1 cgroups outside the agent's pod (a hybrid
    /// host's, `crate::cgroup::hybrid`).
    LeavePodV1Cgroups,
    /// Placing `/dev/null` and its output at fds 0 to 2.
    Stdio,
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
    /// Setting its resource limits.
    Limits,
    /// Setting its umask.
    Umask,
    /// Dropping capabilities from its bounding set.
    Bounding,
    /// Keeping its capabilities across the change of user.
    KeepCaps,
    /// Raising its ambient capabilities.
    Ambient,
    /// Installing its system call filter.
    Seccomp,
}

impl SetupStep {
    const ALL: [SetupStep; 16] = [
        SetupStep::JoinCgroup,
        SetupStep::LeavePodV1Cgroups,
        SetupStep::Stdio,
        SetupStep::NewSession,
        SetupStep::NoNewPrivs,
        SetupStep::Groups,
        SetupStep::Gid,
        SetupStep::Uid,
        SetupStep::WorkingDir,
        SetupStep::ListenFds,
        SetupStep::Limits,
        SetupStep::Umask,
        SetupStep::Bounding,
        SetupStep::KeepCaps,
        SetupStep::Ambient,
        SetupStep::Seccomp,
    ];

    fn code(self) -> u8 {
        match self {
            SetupStep::JoinCgroup => launch::JOIN_CGROUP,
            SetupStep::LeavePodV1Cgroups => launch::JOIN_V1_CGROUPS,
            SetupStep::Stdio => b'o',
            SetupStep::NewSession => b's',
            SetupStep::NoNewPrivs => b'n',
            SetupStep::Groups => b'G',
            SetupStep::Gid => b'g',
            SetupStep::Uid => b'u',
            SetupStep::WorkingDir => b'w',
            SetupStep::ListenFds => b'l',
            SetupStep::Limits => b'r',
            SetupStep::Umask => b'm',
            SetupStep::Bounding => b'b',
            SetupStep::KeepCaps => b'k',
            SetupStep::Ambient => b'a',
            SetupStep::Seccomp => b'f',
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
            SetupStep::LeavePodV1Cgroups => "leave the agent pod's cgroup v1 cgroups",
            SetupStep::Stdio => "set up its standard input and output",
            SetupStep::NewSession => "start a new session",
            SetupStep::NoNewPrivs => "set no_new_privs",
            SetupStep::Groups => "set its supplementary groups",
            SetupStep::Gid => "set its gid",
            SetupStep::Uid => "set its uid",
            SetupStep::WorkingDir => "enter its working directory",
            SetupStep::ListenFds => "place its listening sockets at fds 3..",
            SetupStep::Limits => "set its resource limits",
            SetupStep::Umask => "set its umask",
            SetupStep::Bounding => "drop capabilities from its bounding set",
            SetupStep::KeepCaps => "keep its capabilities across the change of user",
            SetupStep::Ambient => "raise its ambient capabilities",
            SetupStep::Seccomp => "install its system call filter",
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
    /// The sandbox its spec asks for cannot be applied here (SPEC 5.16).
    /// Checked before anything is opened or forked.
    #[error("cannot confine generation {generation} as its spec says: {source}")]
    Confine {
        generation: u64,
        #[source]
        source: crate::confine::ConfineError,
    },
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
    /// The fork failed, or the child ended before it reported anything.
    #[error("cannot start generation {generation}: {source}")]
    Fork {
        generation: u64,
        #[source]
        source: io::Error,
    },
    /// The child could not build its filesystem (SPEC 5.16) and exited
    /// without exec.
    #[error(
        "generation {generation} did not start: the child could not {what} ({source}); nothing of the build ran"
    )]
    Filesystem {
        generation: u64,
        what: String,
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

/// The codes the filesystem's steps report with, one each (the last is
/// shared past 127 steps).
const FILESYSTEM_CODES: std::ops::RangeInclusive<u8> = 0x80..=0xff;

/// What `spec`'s `Protected` filesystem keeps: the writable paths and the
/// run dir writable, the executable, the working directory and a tree's
/// root readable.
fn filesystem_request(
    spec: &SpawnSpec,
    sandbox: &crate::confine::SandboxSpec,
    tree: Option<&Path>,
) -> crate::confine::filesystem::FsRequest {
    let mut readable = vec![spec.exe.clone()];
    readable.extend(spec.readable.iter().cloned());
    readable.extend(spec.working_dir.iter().cloned());
    crate::confine::filesystem::FsRequest {
        socket: spec.socket.clone(),
        writable: sandbox.writable_paths.clone(),
        readable,
        root: tree.map(Path::to_path_buf),
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
/// between tries. A failed exec leaves nothing behind (the launcher reaps the
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
    let tree = build_root(spec)?;
    let plan = Plan::new(spec, tree)?;
    // What the child execs, as it sees it.
    let exec_path = match tree {
        Some(tree) => inside(tree, &spec.exe).ok_or_else(|| SpawnError::Confine {
            generation,
            source: crate::confine::ConfineError::RootBuild(format!(
                "{}: it lies outside the tree {}",
                spec.exe.display(),
                tree.display()
            )),
        })?,
        None => spec.exe.clone(),
    };
    let confinement = match &spec.sandbox {
        Some(sandbox) => Some(
            crate::confine::HostFacts::read()
                .and_then(|facts| crate::confine::Confinement::resolve(sandbox, &facts))
                .map_err(|source| SpawnError::Confine { generation, source })?,
        ),
        None => None,
    };
    let prepare = |what: &str, source: io::Error| SpawnError::Prepare {
        generation,
        what: what.to_owned(),
        source,
    };
    // Every descriptor the child places is a copy above the floor first,
    // so no dup2 of the plan overwrites the source of another.
    let high = |fd: &OwnedFd, what: &str| {
        launch::fd_at_least(fd, SETUP_FD_FLOOR).map_err(|e| prepare(what, e))
    };
    let null: OwnedFd = File::open("/dev/null")
        .map_err(|e| prepare("open /dev/null", e))?
        .into();
    let mut held = vec![high(&null, "open /dev/null")?];
    let mut stdio = vec![(held[0].as_raw_fd(), 0)];
    for (output, to) in [(&spec.stdout, 1), (&spec.stderr, 2)] {
        if let Some(fd) = output_fd(output, generation)? {
            let fd = high(&fd, "duplicate the output descriptor")?;
            stdio.push((fd.as_raw_fd(), to));
            held.push(fd);
        }
    }
    let mut steps: Vec<(u8, ChildStep)> = stdio
        .into_iter()
        .map(|(from, to)| (SetupStep::Stdio.code(), ChildStep::Dup2 { from, to }))
        .collect();
    // Out of the agent's session, so a terminal's signals to the agent do
    // not reach instances.
    steps.push((SetupStep::NewSession.code(), ChildStep::Setsid));
    // The mounts while root, and before the working directory is entered
    // and the listeners placed (the mounts' descriptors lie above both).
    let mut filesystem_steps = Vec::new();
    if let Some(sandbox) = spec.sandbox.as_ref().filter(|s| {
        confinement.is_some() && s.filesystem == genswap_crds::FilesystemProfile::Protected
    }) {
        let prepared = crate::confine::filesystem::prepare(&filesystem_request(
            spec, sandbox, tree,
        ))
        .map_err(|e| SpawnError::Confine {
            generation,
            source: e.into(),
        })?;
        held.extend(prepared.held);
        for (i, (what, step)) in prepared.steps.into_iter().enumerate() {
            let code = FILESYSTEM_CODES
                .start()
                .saturating_add(u8::try_from(i).unwrap_or(u8::MAX));
            steps.push((code, step));
            filesystem_steps.push(what);
        }
    }
    // Limits and the bounding set while still root: raising a hard limit
    // and dropping a capability both need the agent's privileges.
    let ambient = confinement.as_ref().and_then(|c| {
        let becomes_root = plan.uid.unwrap_or_else(geteuid).is_root();
        (c.keep != 0 && !becomes_root).then_some(c.keep)
    });
    if let Some(c) = &confinement {
        for limit in &c.limits {
            steps.push((
                SetupStep::Limits.code(),
                ChildStep::Rlimit {
                    resource: limit.resource,
                    soft: limit.soft,
                    hard: limit.hard,
                },
            ));
        }
        steps.push((SetupStep::Umask.code(), ChildStep::Umask(c.umask)));
        steps.push((
            SetupStep::Bounding.code(),
            ChildStep::DropBounding {
                keep: c.keep,
                last: c.last_cap,
            },
        ));
    }
    if ambient.is_some() {
        steps.push((SetupStep::KeepCaps.code(), ChildStep::KeepCaps));
    }
    steps.push((SetupStep::NoNewPrivs.code(), ChildStep::NoNewPrivs));
    if let Some(gid) = plan.gid {
        steps.push((SetupStep::Groups.code(), ChildStep::Groups(gid)));
        steps.push((SetupStep::Gid.code(), ChildStep::Gid(gid)));
    }
    if let Some(uid) = plan.uid {
        steps.push((SetupStep::Uid.code(), ChildStep::Uid(uid)));
    }
    if let Some(keep) = ambient {
        steps.push((SetupStep::Ambient.code(), ChildStep::RaiseAmbient { keep }));
    }
    if let Some(dir) = plan.working_dir {
        steps.push((SetupStep::WorkingDir.code(), ChildStep::Chdir(dir)));
    }
    for (to, listener) in (LISTEN_FDS_START..).zip(&spec.listeners) {
        let fd = high(&listener.fd, "copy the listening sockets")?;
        let from = fd.as_raw_fd();
        held.push(fd);
        steps.push((SetupStep::ListenFds.code(), ChildStep::Dup2 { from, to }));
    }
    // Last before the exec: the steps above may make calls it refuses.
    if let Some(program) = confinement.and_then(|c| c.seccomp) {
        steps.push((SetupStep::Seccomp.code(), ChildStep::Seccomp(program)));
    }
    let pid_variable = (!spec.listeners.is_empty()).then_some(ENV_LISTEN_PID);
    let image = ExecImage::named(
        &exec_path,
        spec.argv0.as_deref(),
        &spec.args,
        &plan.env,
        pid_variable,
    )
    .map_err(|e| prepare("prepare the exec", e))?;
    let launch = Launch {
        cgroup: spec.cgroup.path().to_path_buf(),
        steps,
        image,
    };
    let launched = launch.start().map_err(|error| match error {
        LaunchError::OpenCgroup { path, source } => SpawnError::OpenCgroup {
            generation,
            path,
            source,
        },
        LaunchError::Refused { source, .. } => SpawnError::Setup {
            generation,
            step: SetupStep::JoinCgroup,
            source,
        },
        LaunchError::Start(source) => SpawnError::Fork { generation, source },
    })?;
    // The child has its copies (or is gone).
    drop(held);
    let child = match launched {
        Launched::Running(child) => child,
        Launched::ExecFailed(errno) => {
            let source = io::Error::from(errno);
            return Err(match missing_interpreter(&spec.exe, tree, &source) {
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
            });
        }
        Launched::StepFailed { code, errno } if FILESYSTEM_CODES.contains(&code) => {
            let what = filesystem_steps
                .get(usize::from(code - FILESYSTEM_CODES.start()))
                .cloned()
                .unwrap_or_else(|| "build its filesystem".into());
            return Err(SpawnError::Filesystem {
                generation,
                what,
                source: io::Error::from(errno.unwrap_or(Errno::UnknownErrno)),
            });
        }
        Launched::StepFailed { code, errno } => {
            let source = io::Error::from(errno.unwrap_or(Errno::UnknownErrno));
            return Err(match SetupStep::from_code(code) {
                Some(step) => SpawnError::Setup {
                    generation,
                    step,
                    source,
                },
                None => SpawnError::Fork { generation, source },
            });
        }
        Launched::Vanished => {
            return Err(SpawnError::Fork {
                generation,
                source: io::Error::other("the child ended before it reported its setup"),
            });
        }
    };
    let pid = child.pid;
    Ok(Spawned {
        exit: ExitWatch::new(child),
        pid,
        resolved_exe: match tree {
            // Already real: the store resolved it inside the tree.
            Some(_) => Some(exec_path),
            None => std::fs::canonicalize(&spec.exe).ok(),
        },
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
fn missing_interpreter(exe: &Path, tree: Option<&Path>, error: &io::Error) -> Option<PathBuf> {
    if error.raw_os_error() != Some(Errno::ENOENT as i32) || !exe.exists() {
        return None;
    }
    script_interpreter(exe).filter(|interpreter| match tree {
        Some(tree) => !tree
            .join(interpreter.strip_prefix("/").unwrap_or(interpreter))
            .exists(),
        None => !interpreter.exists(),
    })
}

/// The build's tree that becomes `/` under `process.root: build`.
fn build_root(spec: &SpawnSpec) -> Result<Option<&Path>, SpawnError> {
    let Some(sandbox) = spec
        .sandbox
        .as_ref()
        .filter(|s| s.root == genswap_crds::RootProfile::Build)
    else {
        return Ok(None);
    };
    let refuse = |why: &str| SpawnError::Confine {
        generation: spec.generation,
        source: crate::confine::ConfineError::RootBuild(why.to_owned()),
    };
    if sandbox.filesystem != genswap_crds::FilesystemProfile::Protected {
        return Err(refuse(
            "under the Host filesystem: the tree is mounted as / in a mount namespace of its own",
        ));
    }
    match sandbox.tree.as_deref() {
        Some(tree) => Ok(Some(tree)),
        None => Err(refuse(
            "a single-file build: it needs a tree (an image, or an archive with artifact.unpack)",
        )),
    }
}

/// `path` on the node as the process sees it inside `tree`.
fn inside(tree: &Path, path: &Path) -> Option<PathBuf> {
    path.strip_prefix(tree)
        .ok()
        .map(|rest| Path::new("/").join(rest))
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
    /// `tree`: the root of `process.root: build`, inside which a working
    /// directory on the node is taken.
    fn new(spec: &SpawnSpec, tree: Option<&Path>) -> Result<Plan, SpawnError> {
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
                ENV_TARGET_SOCKET,
                ENV_TARGET_PID,
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
        match spec.target_pid {
            None => env.push((ENV_SOCKET.to_owned(), socket.to_owned())),
            Some(pid) => {
                env.push((ENV_TARGET_SOCKET.to_owned(), socket.to_owned()));
                env.push((ENV_TARGET_PID.to_owned(), pid.to_string()));
            }
        }
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
            .map(|dir| match tree.and_then(|tree| inside(tree, dir)) {
                Some(in_tree) => in_tree,
                None => dir.clone(),
            })
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

/// The descriptor the child's stdout or stderr becomes; `None` keeps the
/// agent's.
fn output_fd(output: &Output, generation: u64) -> Result<Option<OwnedFd>, SpawnError> {
    let prepare = |what: String, source| SpawnError::Prepare {
        generation,
        what,
        source,
    };
    match output {
        Output::Inherit => Ok(None),
        Output::Null => OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map(|file| Some(file.into()))
            .map_err(|e| prepare("open /dev/null".into(), e)),
        Output::Fd(fd) => fd
            .try_clone()
            .map(Some)
            .map_err(|e| prepare("duplicate the output descriptor".into(), e)),
        Output::Append(path) => OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o640)
            .open(path)
            .map(|file| Some(file.into()))
            .map_err(|e| prepare(format!("open the output file {}", path.display()), e)),
    }
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
    use crate::launch::EXEC_NEXT;

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
