//! Commands the agent runs against a generation (exec probes, `preStop`
//! hooks), bounded by that generation (SPEC 5.12).
//!
//! Each runs as the instance's user, with its environment (`GENSWAP_*`
//! included), in a fresh cgroup `cmd-<k>` below the generation's own: the
//! generation's limits bound it, and nothing it forks escapes. When it ends,
//! times out or is abandoned, its cgroup is killed and proven empty
//! (`populated 0`) before it is removed; [`kill_commands`] does the same for
//! every command of a generation before the generation is stopped, and
//! recovery calls it for what an agent crash left.
//!
//! The cgroup v2 rule that a cgroup with processes may not enable
//! controllers for its children does not bite: a generation's cgroup
//! enables none, so its command cgroups are plain members of its subtree.

use std::fmt;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::time::Instant;

use crate::cgroup::Cgroup;
use crate::observation::Observation;
use crate::spawn::{DEFAULT_PATH, Output, SpawnSpec};

/// The prefix of a command cgroup's name, below its generation's cgroup.
pub const COMMAND_CGROUP_PREFIX: &str = "cmd-";
/// How long a killed command's cgroup may take to empty.
const KILL_WAIT: Duration = Duration::from_secs(10);
/// How long the output is read after the command exits.
const OUTPUT_GRACE: Duration = Duration::from_millis(50);
/// How much of a command's output a reason quotes.
const OUTPUT_QUOTED: usize = 512;

/// A command line: the program and its arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandSpec {
    argv: Vec<String>,
}

impl CommandSpec {
    /// `None` for an empty command.
    pub fn new(argv: &[String]) -> Option<CommandSpec> {
        (!argv.is_empty()).then(|| CommandSpec {
            argv: argv.to_vec(),
        })
    }
}

impl fmt::Display for CommandSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.argv)
    }
}

/// How one command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandEnd {
    /// It exited, or was killed by a signal someone else sent.
    Exited {
        status: std::process::ExitStatus,
        /// The start of what it wrote to stdout and stderr.
        output: String,
    },
    /// It outlived its limit and was killed, with proof.
    TimedOut { after: Duration, output: String },
}

/// Why a command could not be run, or not be proven gone.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("{command}: the program {program:?} is not found in PATH {path:?}")]
    NotFound {
        command: String,
        program: String,
        path: String,
    },
    #[error("{command}: a program path must be absolute or a bare name looked up in PATH")]
    RelativeProgram { command: String },
    #[error("{command}: its cgroup {} cannot be made: {source}", path.display())]
    Cgroup {
        command: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{command}: {source}")]
    Spawn {
        command: String,
        source: crate::spawn::SpawnError,
    },
    #[error("{command}: its output pipe cannot be made: {source}")]
    Pipe { command: String, source: io::Error },
    #[error("{command}: its cgroup {} was not proven empty after a kill: {source}", path.display())]
    NotProvenGone {
        command: String,
        path: PathBuf,
        source: crate::cgroup::CgroupError,
    },
}

/// How one generation's commands run: as whom, with what environment,
/// and below which cgroup.
#[derive(Clone, Debug)]
pub struct GenerationCommands {
    cgroup: Cgroup,
    mount: Option<PathBuf>,
    socket: PathBuf,
    generation: u64,
    build: String,
    env: Vec<(String, String)>,
    working_dir: Option<PathBuf>,
    uid: Option<u32>,
    gid: Option<u32>,
    allow_root: bool,
    sandbox: Arc<crate::confine::SandboxSpec>,
    next: Arc<AtomicU64>,
}

/// Who a generation's commands run as, and where.
#[derive(Clone, Debug, Default)]
pub struct CommandIdentity {
    pub env: Vec<(String, String)>,
    pub working_dir: Option<PathBuf>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub allow_root: bool,
    /// The generation's sandbox, which its commands run in too.
    pub sandbox: crate::confine::SandboxSpec,
}

impl GenerationCommands {
    /// Commands of generation `generation` (cgroup `cgroup` in the cgroup2
    /// mount `mount`, socket `socket`, build `build`), run as `identity`.
    pub fn new(
        cgroup: Cgroup,
        mount: Option<&Path>,
        socket: impl Into<PathBuf>,
        generation: u64,
        build: impl Into<String>,
        identity: CommandIdentity,
    ) -> GenerationCommands {
        GenerationCommands {
            cgroup,
            mount: mount.map(Path::to_path_buf),
            socket: socket.into(),
            generation,
            build: build.into(),
            env: identity.env,
            working_dir: identity.working_dir,
            uid: identity.uid,
            gid: identity.gid,
            allow_root: identity.allow_root,
            sandbox: Arc::new(identity.sandbox),
            next: Arc::new(AtomicU64::new(1)),
        }
    }

    /// These commands with `name=value` in their environment as well.
    pub fn with_var(mut self, name: &str, value: String) -> GenerationCommands {
        self.env.retain(|(existing, _)| existing != name);
        self.env.push((name.to_string(), value));
        self
    }

    /// The generation's cgroup, which every command runs below.
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Runs `command` to its end or `limit`, whichever is first; past the
    /// limit it is killed with proof. Anything it left running when it
    /// exited is killed too: no command outlives its own run.
    pub async fn run(
        &self,
        command: &CommandSpec,
        limit: Duration,
    ) -> Result<CommandEnd, CommandError> {
        let text = command.to_string();
        let exe = self.resolve(command, &text)?;
        let cgroup = self.fresh_cgroup(&text)?;
        let guard = KillOnDrop(Some(cgroup.clone()));
        let (reader, writer) = output_pipe().map_err(|source| CommandError::Pipe {
            command: text.clone(),
            source,
        })?;
        let writer = Arc::new(writer);
        let mut request = SpawnSpec::new(
            exe,
            cgroup.clone(),
            &self.socket,
            self.generation,
            &self.build,
        );
        request.args = command.argv[1..].to_vec();
        request.env = self.env.clone();
        request.working_dir = self.working_dir.clone();
        request.uid = self.uid;
        request.gid = self.gid;
        request.allow_root = self.allow_root;
        request.sandbox = Some(crate::confine::SandboxSpec::clone(&self.sandbox));
        request.stdout = Output::Fd(writer.clone());
        request.stderr = Output::Fd(writer);
        let started = Instant::now();
        let mut child = match crate::spawn::spawn(request).await {
            Ok(child) => child,
            Err(source) => {
                let _ = guard.finish().await;
                return Err(CommandError::Spawn {
                    command: text,
                    source,
                });
            }
        };
        let mut reader = reader;
        let mut reading = tokio::spawn(async move {
            let mut output = Vec::new();
            let mut chunk = [0u8; 1024];
            // To end-of-file; only the first bytes are kept.
            while let Ok(n) = reader.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                if output.len() < OUTPUT_QUOTED {
                    output.extend_from_slice(&chunk[..n.min(OUTPUT_QUOTED - output.len())]);
                }
            }
            output
        });
        let waited = tokio::time::timeout(limit, child.wait()).await;
        let after = started.elapsed();
        let mut output = None;
        if waited.is_ok() {
            // What it wrote is in the pipe; a process it left behind may
            // hold the pipe open, so the read gets a moment before the kill.
            if let Ok(Ok(read)) = tokio::time::timeout(OUTPUT_GRACE, &mut reading).await {
                output = Some(read);
            }
        }
        let gone = guard.finish().await;
        // Killed with everything it forked, so the pipe is closed.
        let output = match output {
            Some(read) => read,
            None => match tokio::time::timeout(OUTPUT_GRACE, &mut reading).await {
                Ok(Ok(read)) => read,
                _ => {
                    reading.abort();
                    Vec::new()
                }
            },
        };
        let output = quoted(&output);
        let _ = child.wait().await;
        gone.map_err(|source| CommandError::NotProvenGone {
            command: text.clone(),
            path: cgroup.path().to_path_buf(),
            source,
        })?;
        match waited {
            Ok(Ok(status)) => Ok(CommandEnd::Exited { status, output }),
            Ok(Err(source)) => Err(CommandError::Spawn {
                command: text,
                source,
            }),
            Err(_) => Ok(CommandEnd::TimedOut { after, output }),
        }
    }

    /// An exec probe's try: exit 0 within `limit` is healthy.
    pub async fn probe(&self, command: &CommandSpec, limit: Duration) -> Result<(), Observation> {
        use std::os::unix::process::ExitStatusExt;
        match self.run(command, limit).await {
            Ok(CommandEnd::Exited { status, .. }) if status.success() => Ok(()),
            Ok(CommandEnd::Exited { status, output }) => {
                let how = genswap_crds::exit_text(status.code(), status.signal());
                Err(Observation::Command(with_output(
                    format!("{command} ended unhealthy: {how}"),
                    &output,
                )))
            }
            Ok(CommandEnd::TimedOut { after, output }) => Err(Observation::Command(with_output(
                format!("{command} did not finish within {after:.1?}; it was killed"),
                &output,
            ))),
            Err(error) => Err(Observation::Command(error.to_string())),
        }
    }

    fn resolve(&self, command: &CommandSpec, text: &str) -> Result<PathBuf, CommandError> {
        let program = &command.argv[0];
        if program.contains('/') && !program.starts_with('/') {
            return Err(CommandError::RelativeProgram {
                command: text.to_string(),
            });
        }
        let search = self
            .env
            .iter()
            .find(|(name, _)| name == "PATH")
            .map_or(DEFAULT_PATH, |(_, value)| value.as_str());
        let not_found = |program: String| CommandError::NotFound {
            command: text.to_string(),
            program,
            path: search.to_string(),
        };
        // Under `process.root: build`, looked up as the command will see
        // it: inside the generation's tree, never through a link out. The
        // path as named, not the link's target, so a multi-call program
        // (busybox's `sh`) still learns its name from argv[0].
        if let Some(tree) = self
            .sandbox
            .tree
            .as_deref()
            .filter(|_| self.sandbox.root == genswap_crds::RootProfile::Build)
        {
            let candidates: Vec<String> = if program.starts_with('/') {
                vec![program.clone()]
            } else {
                search
                    .split(':')
                    .filter(|dir| dir.starts_with('/'))
                    .map(|dir| format!("{}/{program}", dir.trim_end_matches('/')))
                    .collect()
            };
            return candidates
                .into_iter()
                .find(|c| genswap_store::tree::resolve_entrypoint(tree, c).is_ok())
                .map(|found| tree.join(found.trim_start_matches('/')))
                .ok_or_else(|| not_found(format!("{program} in the tree {}", tree.display())));
        }
        if program.starts_with('/') {
            return Ok(PathBuf::from(program));
        }
        search
            .split(':')
            .filter(|dir| dir.starts_with('/'))
            .map(|dir| Path::new(dir).join(program))
            .find(|candidate| is_executable(candidate))
            .ok_or_else(|| not_found(program.clone()))
    }

    fn fresh_cgroup(&self, text: &str) -> Result<Cgroup, CommandError> {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            let path = self
                .cgroup
                .path()
                .join(format!("{COMMAND_CGROUP_PREFIX}{k}"));
            match fs::create_dir(&path) {
                Ok(()) => return Ok(Cgroup::at(path, self.mount.as_deref())),
                // Left by an earlier agent: recovery kills those; this one
                // takes the next number.
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {}
                Err(source) => {
                    return Err(CommandError::Cgroup {
                        command: text.to_string(),
                        path,
                        source,
                    });
                }
            }
        }
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

fn quoted(output: &[u8]) -> String {
    String::from_utf8_lossy(output).trim().to_string()
}

fn with_output(reason: String, output: &str) -> String {
    if output.is_empty() {
        reason
    } else {
        format!("{reason}; it wrote: {output}")
    }
}

fn output_pipe() -> io::Result<(tokio::net::unix::pipe::Receiver, OwnedFd)> {
    let (read, write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)?;
    let receiver = tokio::net::unix::pipe::Receiver::from_owned_fd(read)?;
    Ok((receiver, write))
}

/// A command's cgroup, killed and removed however its run ends: when the
/// run's future is dropped (an attempt cancelled, a generation retiring),
/// the kill is written at once and the wait for `populated 0` finishes on
/// the runtime.
struct KillOnDrop(Option<Cgroup>);

impl KillOnDrop {
    async fn finish(mut self) -> Result<(), crate::cgroup::CgroupError> {
        let Some(cgroup) = self.0.take() else {
            return Ok(());
        };
        kill_and_remove(&cgroup).await
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let Some(cgroup) = self.0.take() else {
            return;
        };
        let _ = fs::write(cgroup.path().join("cgroup.kill"), "1");
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = kill_and_remove(&cgroup).await {
                    tracing::error!(cgroup = %cgroup.path().display(), %error, "an abandoned command was not proven gone");
                }
            });
        }
    }
}

async fn kill_and_remove(cgroup: &Cgroup) -> Result<(), crate::cgroup::CgroupError> {
    cgroup.kill(KILL_WAIT).await?;
    cgroup.remove()
}

/// Kills every command still running below `generation` with proof and
/// removes their cgroups. Returns how many cgroups there were.
pub async fn kill_commands(generation: &Cgroup) -> Result<usize, crate::cgroup::CgroupError> {
    let mut killed = 0;
    for path in command_cgroups(generation.path()) {
        kill_and_remove(&Cgroup::at(path, None)).await?;
        killed += 1;
    }
    Ok(killed)
}

/// The command cgroups below a generation's cgroup.
pub fn command_cgroups(generation: &Path) -> Vec<PathBuf> {
    child_cgroups(generation, COMMAND_CGROUP_PREFIX)
}

/// The cgroups below `generation` whose names start with `prefix`.
pub(crate) fn child_cgroups(generation: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(generation) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|entry| {
            entry
                .file_name()
                .to_str()
                .is_some_and(|name| name.starts_with(prefix))
        })
        .map(|entry| entry.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_command_is_no_command() {
        assert!(CommandSpec::new(&[]).is_none());
        let command = CommandSpec::new(&["/bin/true".into(), "x".into()]).unwrap();
        assert_eq!(command.to_string(), r#"["/bin/true", "x"]"#);
    }

    #[test]
    fn a_bare_name_is_found_in_the_instance_path() {
        let commands = GenerationCommands::new(
            Cgroup::at("/nonexistent", None),
            None,
            "/run/x.sock",
            1,
            "b",
            CommandIdentity::default(),
        );
        let sh = CommandSpec::new(&["sh".into()]).unwrap();
        let found = commands.resolve(&sh, "sh").unwrap();
        assert!(found.is_absolute() && found.ends_with("sh"), "{found:?}");
        let relative = CommandSpec::new(&["./probe".into()]).unwrap();
        assert!(matches!(
            commands.resolve(&relative, "x"),
            Err(CommandError::RelativeProgram { .. })
        ));
        let missing = CommandSpec::new(&["no-such-program-anywhere".into()]).unwrap();
        assert!(matches!(
            commands.resolve(&missing, "x"),
            Err(CommandError::NotFound { .. })
        ));
    }
}
