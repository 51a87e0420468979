//! A real `node-agent standalone` process over a manifest directory in the
//! sandbox, and the manifests the benchmark writes to drive it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use genswap_crds::{Mode, Outcome};
use nix::sys::signal::Signal;
use node_agent::standalone::{STATUS_SUBDIR, StatusDocument, wait_for_status};

use crate::BenchError;
use crate::sandbox::{Guarded, Sandbox};

/// The uid and gid instances run as (`nobody`).
pub const NOBODY: u32 = 65534;
/// The namespace of every benchmark instance.
pub const NAMESPACE: &str = "bench";

/// The directories one agent works in.
#[derive(Clone, Debug)]
pub struct AgentDirs {
    /// The manifest directory (`--dir`).
    pub manifests: PathBuf,
    /// `--state-dir`.
    pub state: PathBuf,
    /// `--run-dir`.
    pub run: PathBuf,
    /// `--staging-root`: builds are made here.
    pub staging: PathBuf,
    /// `--cgroup-root`.
    pub cgroup_root: PathBuf,
    /// The agent's stderr (and its instances').
    pub log: PathBuf,
}

impl AgentDirs {
    /// The layout inside `sandbox`, created.
    pub fn create(sandbox: &Sandbox) -> Result<AgentDirs, BenchError> {
        let dir = sandbox.dir();
        let dirs = AgentDirs {
            manifests: dir.join("manifests"),
            state: dir.join("state"),
            run: sandbox.run_dir().to_path_buf(),
            staging: dir.join("staging"),
            cgroup_root: sandbox.cgroup().join("agent"),
            log: dir.join("agent.log"),
        };
        for path in [&dirs.manifests, &dirs.staging, &dirs.cgroup_root] {
            fs::create_dir_all(path).map_err(|source| BenchError::Setup {
                what: format!("create {}", path.display()),
                source,
            })?;
        }
        Ok(dirs)
    }

    /// `<run>/<namespace>.<name>`: where `current.sock` is (the bench's
    /// names are short, never cut).
    pub fn instance_run_dir(&self, name: &str) -> PathBuf {
        self.run.join(format!("{NAMESPACE}.{name}"))
    }

    /// The instance's `current.sock`.
    pub fn current_sock(&self, name: &str) -> PathBuf {
        self.instance_run_dir(name).join("current.sock")
    }
}

/// A running `node-agent standalone`.
pub struct Agent {
    process: Guarded,
    /// Its directories.
    pub dirs: AgentDirs,
}

impl Agent {
    /// Starts the agent binary over `dirs`; `stop_on_exit` makes it stop
    /// every instance when it is stopped.
    pub fn start(binary: &Path, dirs: &AgentDirs, stop_on_exit: bool) -> Result<Agent, BenchError> {
        Agent::start_with(binary, dirs, stop_on_exit, &[])
    }

    /// [`start`](Self::start) with `extra` flags.
    pub fn start_with(
        binary: &Path,
        dirs: &AgentDirs,
        stop_on_exit: bool,
        extra: &[&str],
    ) -> Result<Agent, BenchError> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&dirs.log)
            .map_err(|source| BenchError::Setup {
                what: format!("open {}", dirs.log.display()),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| BenchError::Setup {
            what: "duplicate the log file".into(),
            source,
        })?;
        let mut command = Command::new(binary);
        command
            .arg("standalone")
            .arg("--dir")
            .arg(&dirs.manifests)
            .arg("--state-dir")
            .arg(&dirs.state)
            .arg("--run-dir")
            .arg(&dirs.run)
            .arg("--staging-root")
            .arg(&dirs.staging)
            .arg("--log-dir")
            .arg(dirs.state.with_file_name("logs"))
            .arg("--cgroup-root")
            .arg(&dirs.cgroup_root)
            .args(["--node-name", "bench"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        if stop_on_exit {
            command.arg("--stop-on-exit");
        }
        command.args(extra);
        let child = command.spawn().map_err(|source| BenchError::Setup {
            what: format!("start {}", binary.display()),
            source,
        })?;
        let mut agent = Agent {
            process: Guarded::new(child, Signal::SIGTERM),
            dirs: dirs.clone(),
        };
        // Status waits watch the status directory, which the agent makes.
        let status_dir = dirs.manifests.join(STATUS_SUBDIR);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !status_dir.is_dir() {
            agent.check_alive()?;
            if Instant::now() > deadline {
                return Err(BenchError::Agent(format!(
                    "{} did not appear; see {}",
                    status_dir.display(),
                    dirs.log.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(agent)
    }

    /// The agent's pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// SIGTERM and wait for the exit.
    pub fn stop(mut self) -> Result<(), BenchError> {
        let status = self.process.stop().map_err(|source| BenchError::Setup {
            what: "stop the agent".into(),
            source,
        })?;
        if status.success() {
            Ok(())
        } else {
            Err(BenchError::Agent(format!(
                "the agent exited with {status}; see {}",
                self.dirs.log.display()
            )))
        }
    }

    /// Fails when the agent has exited on its own.
    pub fn check_alive(&mut self) -> Result<(), BenchError> {
        match self.process.exited() {
            Some(status) => Err(BenchError::Agent(format!(
                "the agent exited with {status}; see {}",
                self.dirs.log.display()
            ))),
            None => Ok(()),
        }
    }

    /// Writes the manifest of instance `name` (a hidden temp file renamed
    /// into place, so the agent never reads half of it).
    pub fn write_manifest(&self, name: &str, manifest: &str) -> Result<(), BenchError> {
        let temp = self.dirs.manifests.join(format!(".{name}.yaml.tmp"));
        let path = self.dirs.manifests.join(format!("{name}.yaml"));
        fs::write(&temp, manifest)
            .and_then(|()| fs::rename(&temp, &path))
            .map_err(|source| BenchError::Setup {
                what: format!("write {}", path.display()),
                source,
            })
    }

    /// Waits until the status of instance `name` shows a finished attempt
    /// newer than `after_rev`, and returns the status.
    pub async fn wait_attempt_after(
        &self,
        name: &str,
        after_rev: i64,
        timeout: Duration,
    ) -> Result<StatusDocument, BenchError> {
        let file = format!("{name}.yaml");
        wait_for_status(&self.dirs.manifests, &file, timeout, |doc| {
            doc.last_attempt().is_some_and(|a| a.sched_rev > after_rev)
                && doc
                    .attempts
                    .iter()
                    .filter(|a| a.sched_rev > after_rev)
                    .all(|a| a.status.outcome.is_some())
        })
        .await
        .map_err(|e| BenchError::Agent(format!("{name}: {e}")))
    }
}

/// One InstanceGeneration manifest for a benchmark instance: health checked
/// on `/healthz`, no settle window (the benchmark measures the swap, not a
/// canary's watch), a 10 s stop timeout.
pub fn manifest(name: &str, build_id: &str, build: &testapp::Build, mode: Mode) -> String {
    manifest_of(
        name,
        build_id,
        &format!("path: {}", build.path.display()),
        &build.sha256,
        mode,
    )
}

/// The same for an image build, `reference` pinned by `digest` (hex), its
/// entrypoint the image's.
pub fn image_manifest(name: &str, build_id: &str, reference: &str, digest: &str) -> String {
    manifest_of(
        name,
        build_id,
        &format!("image: {reference}"),
        digest,
        Mode::Overlap,
    )
}

/// `artifact` is the artifact's one line (`path: ...`, `image: ...`).
fn manifest_of(name: &str, build_id: &str, artifact: &str, sha: &str, mode: Mode) -> String {
    let mode = match mode {
        Mode::Overlap => "overlap",
        Mode::Hold => "hold",
    };
    format!(
        "apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata:
  name: {name}
  namespace: {NAMESPACE}
spec:
  build:
    id: {build_id}
    artifact:
      {artifact}
    sha256: {sha}
  mode: {mode}
  process:
    user: {NOBODY}
    group: {NOBODY}
  health:
    path: /healthz
    timeoutSeconds: 10
  settle:
    seconds: 0
  stop:
    timeoutSeconds: 10
",
    )
}

/// The attempt's outcome, as a word.
pub fn outcome_word(outcome: Option<Outcome>) -> &'static str {
    match outcome {
        Some(Outcome::Done) => "done",
        Some(Outcome::Failed) => "failed",
        Some(Outcome::Abandoned) => "abandoned",
        Some(Outcome::Down) => "down",
        None => "none",
    }
}
