//! `node-agent demo`: a guided run of standalone mode on this machine, for a
//! newcomer. It needs no cluster: root and a writable cgroup v2 mount.
//!
//! In a fresh temp dir and cgroup subtree it makes four builds of the test
//! app and drives standalone mode (the same scheduler and swap engine as a
//! cluster node) by rewriting one InstanceGeneration file:
//!
//! 1. install `build-1`;
//! 2. an overlap release to `build-2`;
//! 3. `build-2`'s process is SIGKILLed: the agent's supervisor notices it
//!    at once, the status file says `Ready=False GenerationExited`, and
//!    the agent restarts it as the next generation (no attempt, no edit),
//!    after which the status is `Ready=True` with `restarts: 1`;
//! 4. a release of `build-bad`, which answers 500 to its health check:
//!    `failed`, held down, `build-2` keeps serving;
//! 5. a retry of it (`spec.retry` changed): the one re-armed attempt runs,
//!    fails the same way, and the build is held down again; `build-2`
//!    still serves. (A retry re-arms a build; it does not fix it.)
//! 6. a hold release to `build-3`: `build-2` stops before `build-3` starts,
//!    so requests fail in the gap; that is what `hold` means.
//!
//! From step 2 on a client sends requests through `current.sock` without a
//! pause; each step's row counts the requests sent and failed while it ran.
//! Overlap steps must show 0 failed (the kill does fail requests: nothing
//! serves until the restart is healthy). Everything is stopped and removed at
//! the end, on Ctrl-C and on failure too.

pub mod app;
mod traffic;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use genswap_crds::{ConditionType, Mode, Outcome};
use thiserror::Error;
use tokio::sync::oneshot;

use crate::cgroup::{CgroupError, discover_mount};
use crate::engine::EngineConfig;
use crate::gate::InstanceKey;
use crate::host::{Host, HostError, HostSettings};
use crate::logs::{HelperProgram, LogSettings};
use crate::sandbox::{Sandbox, SandboxError};
use crate::standalone::files::replace_file;
use crate::standalone::{
    self, NodeIdentity, StandaloneConfig, StandaloneError, StatusDocument, WaitError,
};
use traffic::{Client, Tally};

/// The demo's instance.
const NAMESPACE: &str = "demo";
const NAME: &str = "hello";
const MANIFEST: &str = "hello.yaml";
/// The uid and gid the instance runs as (`nobody`): not root.
const NOBODY: u32 = 65534;
/// The longest one step may take before the demo gives up.
const STEP_DEADLINE: Duration = Duration::from_secs(60);
/// How long the demo waits for standalone mode to stop everything.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(60);

/// What the demo can be told.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DemoOptions {
    /// The cgroup directory the demo's subtree goes under; default: the
    /// cgroup v2 mount found in `/proc/self/mountinfo`.
    pub cgroup_parent: Option<PathBuf>,
    /// What runs as the log shims and listener keepers.
    pub helper: crate::logs::HelperProgram,
}

/// Why the demo could not run to its end.
#[derive(Debug, Error)]
pub enum DemoError {
    /// The test app is neither built nor buildable here.
    #[error("the test app is not available: {problem}\n  run: {command}")]
    Testapp { problem: String, command: String },
    /// No cgroup v2 hierarchy to run in.
    #[error(
        "the demo needs a writable cgroup v2 hierarchy (run it as root on Linux with cgroup v2): {0}"
    )]
    Cgroup(#[source] CgroupError),
    /// The temp dir or the cgroup subtree could not be set up.
    #[error("cannot {what}: {source}")]
    Setup {
        what: String,
        #[source]
        source: io::Error,
    },
    /// The temp dir or the cgroup subtree could not be set up.
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// The host parts could not be built.
    #[error(transparent)]
    Host(#[from] HostError),
    /// A test-app build could not be made.
    #[error("cannot make a test-app build: {0}")]
    Build(#[source] testapp::Error),
    /// A step did not reach its end in time.
    #[error("step {step}: {source}")]
    Step {
        step: String,
        #[source]
        source: WaitError,
    },
    /// Standalone mode stopped on its own.
    #[error("standalone mode stopped: {0}")]
    Standalone(#[source] StandaloneError),
    /// Standalone mode did not stop within the deadline.
    #[error("standalone mode did not stop within {0:?}")]
    ShutdownTimeout(Duration),
    /// Ctrl-C or SIGTERM.
    #[error("interrupted")]
    Interrupted,
    /// Cleanup failed; the paths say what may be left.
    #[error("cleanup failed: {0}")]
    Cleanup(#[source] io::Error),
}

/// One row of the table: one step.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// What the step did.
    pub step: String,
    /// The attempt's cause.
    pub cause: String,
    /// The mode that ran.
    pub mode: Mode,
    /// How the attempt ended.
    pub outcome: Outcome,
    /// Whether a process of the build started.
    pub executed: bool,
    /// How long the generation this attempt stopped took to exit.
    pub drain_ms: Option<i64>,
    /// Requests sent and failed while the step ran (`None` before the
    /// client starts).
    pub traffic: Option<Tally>,
    /// The build that answered the client last.
    pub serving: Option<String>,
    /// How long the step took.
    pub took: Duration,
    /// The step is the supervisor's restart after a kill, not an attempt.
    pub restart: bool,
}

/// The demo's result.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DemoReport {
    /// One row per step.
    pub rows: Vec<Row>,
}

impl DemoReport {
    /// The table the demo prints.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<32} {:<8} {:<8} {:<10} {:<9} {:>8} {:>7} {:>7}  {:<10} {:>6}",
            "step",
            "cause",
            "mode",
            "outcome",
            "executed",
            "drain",
            "sent",
            "failed",
            "serving",
            "took"
        );
        for row in &self.rows {
            let (sent, failed) = match row.traffic {
                Some(t) => (t.sent.to_string(), t.failed.to_string()),
                None => ("-".into(), "-".into()),
            };
            let _ = writeln!(
                out,
                "{:<32} {:<8} {:<8} {:<10} {:<9} {:>8} {:>7} {:>7}  {:<10} {:>5.1}s",
                row.step,
                row.cause,
                if row.restart {
                    "restart"
                } else {
                    row.mode.as_str()
                },
                row.outcome.as_str(),
                row.executed,
                row.drain_ms
                    .map_or_else(|| "-".to_string(), |ms| format!("{ms} ms")),
                sent,
                failed,
                row.serving.as_deref().unwrap_or("-"),
                row.took.as_secs_f64(),
            );
        }
        out
    }

    /// The story held: the outcomes expected, and no failed request in an
    /// overlap step.
    pub fn as_expected(&self) -> bool {
        let outcomes: Vec<Outcome> = self.rows.iter().map(|r| r.outcome).collect();
        let overlap_clean = self
            .rows
            .iter()
            .filter(|r| r.mode == Mode::Overlap && !r.restart)
            .all(|r| r.traffic.is_none_or(|t| t.failed == 0));
        outcomes
            == [
                Outcome::Done,
                Outcome::Done,
                Outcome::Done,
                Outcome::Failed,
                Outcome::Failed,
                Outcome::Done,
            ]
            && overlap_clean
    }
}

/// Runs the demo to its end and cleans up. See the module docs.
pub async fn run(options: DemoOptions) -> Result<DemoReport, DemoError> {
    println!("genswap demo: standalone mode on this machine, no cluster needed.\n");
    app::ensure_built()?;
    let parent = match options.cgroup_parent {
        Some(parent) => parent,
        None => discover_mount().map_err(DemoError::Cgroup)?,
    };
    let mut sandbox = Sandbox::create(&parent, "genswap-demo")?;
    let result = run_in(&sandbox, &options.helper).await;
    let cleanup = tokio::task::spawn_blocking(move || {
        let cleanup = sandbox.clean_up();
        (sandbox, cleanup)
    })
    .await;
    match cleanup {
        Ok((_, Ok(done))) => {
            println!(
                "\nCleaned up: cgroup subtree {} ({} leftover processes) and {}.",
                done.cgroup.display(),
                done.leftover_processes,
                done.dir.display()
            );
        }
        Ok((_, Err(error))) => {
            if result.is_ok() {
                return Err(DemoError::Cleanup(error));
            }
            eprintln!("genswap demo: cleanup failed too: {error}");
        }
        // The sandbox's own drop cleaned up after the panic.
        Err(join) => std::panic::resume_unwind(join.into_panic()),
    }
    result
}

/// Everything between setting up the sandbox and removing it.
async fn run_in(sandbox: &Sandbox, helper: &HelperProgram) -> Result<DemoReport, DemoError> {
    let dir = sandbox.dir();
    let manifests = dir.join("manifests");
    let staging = dir.join("staging");
    for path in [&manifests, &staging] {
        std::fs::create_dir(path).map_err(|source| DemoError::Setup {
            what: format!("create {}", path.display()),
            source,
        })?;
    }
    let settings = HostSettings {
        cgroup_root: Some(sandbox.cgroup().to_path_buf()),
        run_dir: sandbox.run_dir().to_path_buf(),
        state_dir: dir.join("state"),
        staging_root: staging.clone(),
        store_dir: None,
        tree_limits: genswap_store::TreeLimits::default(),
        registries: Default::default(),
        trust: Default::default(),
        retention: Default::default(),
        engine: EngineConfig::default(),
        logs: LogSettings {
            dir: dir.join("logs"),
            helper: helper.clone(),
            ..LogSettings::default()
        },
    };
    let host = Host::build(&settings)?;
    let key = InstanceKey::new(NAMESPACE, NAME).map_err(|error| DemoError::Setup {
        what: "name the demo instance".into(),
        source: io::Error::new(io::ErrorKind::InvalidInput, error),
    })?;
    let current = host.engine.layout().current_socket(&key);
    println!("  manifest:    {}", manifests.join(MANIFEST).display());
    println!(
        "  status:      {}",
        standalone::status_path(&manifests, MANIFEST).display()
    );
    println!("  current.sock {}", current.display());
    println!("  cgroups:     {}", sandbox.cgroup().display());
    println!();

    let builds = Builds::make(&staging)?;
    let (stop, stopped) = oneshot::channel::<()>();
    let node = NodeIdentity::new(
        crate::host::host_name().unwrap_or_else(|| "this-host".into()),
        BTreeMap::new(),
    );
    let config = StandaloneConfig {
        dir: manifests.clone(),
        node,
        stop_on_exit: true,
        prometheus: None,
    };
    let mut runner = tokio::spawn({
        let engine = host.engine.clone();
        let gate = host.gate.clone();
        let state_dir = settings.state_dir.clone();
        async move {
            standalone::run_with(engine, gate, &state_dir, config, async {
                let _ = stopped.await;
            })
            .await
        }
    });

    let script = Script {
        manifests: &manifests,
        builds: &builds,
        current: &current,
        engine: &host.engine,
        key: &key,
    };
    let outcome = tokio::select! {
        report = script.run() => report,
        () = interrupted() => {
            println!("\nInterrupted: stopping everything and cleaning up.");
            Err(DemoError::Interrupted)
        }
        ended = &mut runner => Err(match ended {
            Ok(Err(error)) => DemoError::Standalone(error),
            Ok(Ok(())) | Err(_) => DemoError::Interrupted,
        }),
    };

    // Stop standalone mode: it stops the instance with proof of exit.
    let _ = stop.send(());
    if !runner.is_finished() {
        match tokio::time::timeout(SHUTDOWN_DEADLINE, &mut runner).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!(%error, "standalone mode ended with an error"),
            Ok(Err(join)) => tracing::warn!(%join, "standalone mode panicked"),
            Err(_) => {
                runner.abort();
                if outcome.is_ok() {
                    return Err(DemoError::ShutdownTimeout(SHUTDOWN_DEADLINE));
                }
            }
        }
    }
    outcome
}

/// Ctrl-C or SIGTERM.
async fn interrupted() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}

/// The four builds, distinct files in the staging root.
struct Builds {
    one: testapp::Build,
    two: testapp::Build,
    bad: testapp::Build,
    three: testapp::Build,
}

impl Builds {
    fn make(staging: &Path) -> Result<Builds, DemoError> {
        let make = |name: &str| testapp::make_build(staging, name).map_err(DemoError::Build);
        Ok(Builds {
            one: make("build-1")?,
            two: make("build-2")?,
            bad: make("build-bad")?,
            three: make("build-3")?,
        })
    }
}

/// What one manifest asks for.
struct Desired<'a> {
    id: &'a str,
    build: &'a testapp::Build,
    mode: Mode,
    retry: &'a str,
    args: &'a [&'a str],
}

impl Desired<'_> {
    /// The InstanceGeneration file: short health and settle windows keep
    /// the demo under a minute.
    fn manifest(&self) -> String {
        let args = self
            .args
            .iter()
            .map(|a| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata:
  name: {NAME}
  namespace: {NAMESPACE}
spec:
  build:
    id: {id}
    artifact:
      path: {path}
    sha256: {sha}
  mode: {mode}
  retry: \"{retry}\"
  process:
    args: [{args}]
    user: {NOBODY}
    group: {NOBODY}
  health:
    path: /healthz
    timeoutSeconds: 3
  settle:
    seconds: 1
  stop:
    timeoutSeconds: 5
",
            id = self.id,
            path = self.build.path.display(),
            sha = self.build.sha256,
            mode = self.mode.as_str(),
            retry = self.retry,
        )
    }
}

struct Script<'a> {
    manifests: &'a Path,
    builds: &'a Builds,
    current: &'a Path,
    engine: &'a crate::engine::Engine,
    key: &'a InstanceKey,
}

impl Script<'_> {
    async fn run(&self) -> Result<DemoReport, DemoError> {
        let b = self.builds;
        let mut report = DemoReport::default();
        let mut last_rev = 0;

        let (row, doc) = self
            .step(
                "1/6",
                "install build-1",
                "The file appears; standalone mode plans an install and the engine starts \
                 generation 1 in its own cgroup, health-checks it on its own socket and \
                 points current.sock at it.",
                &Desired {
                    id: "build-1",
                    build: &b.one,
                    mode: Mode::Overlap,
                    retry: "",
                    args: &[],
                },
                last_rev,
                None,
            )
            .await?;
        last_rev = newest_rev(&doc);
        report.rows.push(row);

        println!("Starting a client that sends requests through current.sock without a pause.\n");
        let client = Client::start(self.current.to_path_buf());

        let (number, title, story, desired) = (
            "2/6",
            "release build-2 (overlap)",
            "build-2 starts beside build-1, becomes healthy, takes over current.sock \
                 by an atomic rename, then build-1 drains and is proven stopped.",
            Desired {
                id: "build-2",
                build: &b.two,
                mode: Mode::Overlap,
                retry: "",
                args: &[],
            },
        );
        let (row, doc) = self
            .step(number, title, story, &desired, last_rev, Some(&client))
            .await?;
        last_rev = newest_rev(&doc);
        report.rows.push(row);

        let (row, doc) = self.kill_and_watch_it_return(&client).await?;
        last_rev = newest_rev(&doc).max(last_rev);
        report.rows.push(row);

        let steps: [(&str, &str, &str, Desired<'_>); 3] = [
            (
                "4/6",
                "release build-bad (overlap)",
                "build-bad answers 500 to its health check: the attempt fails, build-bad is \
                 stopped and held down (Stalled=True), and build-2 never stops serving.",
                Desired {
                    id: "build-bad",
                    build: &b.bad,
                    mode: Mode::Overlap,
                    retry: "",
                    args: &["--status=500"],
                },
            ),
            (
                "5/6",
                "retry build-bad (spec.retry)",
                "Changing spec.retry re-arms exactly one attempt of the held-down build. It \
                 is the same build, so it fails the same way and is held down again: a retry \
                 re-arms a build, it does not fix it. build-2 still serves.",
                Desired {
                    id: "build-bad",
                    build: &b.bad,
                    mode: Mode::Overlap,
                    retry: "1",
                    args: &["--status=500"],
                },
            ),
            (
                "6/6",
                "release build-3 (hold)",
                "A hold stops build-2 first and then starts build-3: the requests that arrive \
                 in between fail. That gap is what mode: hold trades for never running two \
                 generations at once.",
                Desired {
                    id: "build-3",
                    build: &b.three,
                    mode: Mode::Hold,
                    retry: "1",
                    args: &[],
                },
            ),
        ];
        for (number, title, story, desired) in steps {
            let (row, doc) = self
                .step(number, title, story, &desired, last_rev, Some(&client))
                .await?;
            last_rev = newest_rev(&doc);
            report.rows.push(row);
        }
        drop(client);

        println!("\n{}", report.table());
        if report.as_expected() {
            println!(
                "Every overlap step answered every request; the killed process came back with no \
                 edit; the failed build never took traffic; the hold step shows the gap a hold costs."
            );
        } else {
            println!(
                "WARNING: the run did not go as the story says; the table shows what happened."
            );
        }
        Ok(report)
    }

    /// Waits until the status file is `accept`ed, within the step deadline.
    async fn wait(
        &self,
        step: &str,
        accept: impl FnMut(&StatusDocument) -> bool,
    ) -> Result<StatusDocument, DemoError> {
        standalone::wait_for_status(self.manifests, MANIFEST, STEP_DEADLINE, accept)
            .await
            .map_err(|source| DemoError::Step {
                step: step.to_string(),
                source,
            })
    }

    /// SIGKILLs the serving generation and waits until the status file has
    /// said it is down and then that the agent's restart serves.
    async fn kill_and_watch_it_return(
        &self,
        client: &Client,
    ) -> Result<(Row, StatusDocument), DemoError> {
        let title = "SIGKILL build-2's process";
        println!(
            "3/6 {title}\n    Nothing edits the manifest: the agent's supervisor notices the exit \
             at once (a pidfd), reaps it, says Ready=False GenerationExited, and restarts \
             build-2 as the next generation; current.sock moves to it once it is healthy."
        );
        let serving = self
            .engine
            .serving(self.key)
            .ok_or_else(|| DemoError::Setup {
                what: "find the serving generation".into(),
                source: io::Error::other("nothing serves"),
            })?;
        let before = client.tally();
        let started = Instant::now();
        let pid = nix::unistd::Pid::from_raw(i32::try_from(serving.pid).unwrap_or(i32::MAX));
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).map_err(|errno| {
            DemoError::Setup {
                what: format!("SIGKILL pid {}", serving.pid),
                source: io::Error::from(errno),
            }
        })?;
        let mut saw_down = String::new();
        let doc = self
            .wait(title, |doc| {
                let node = doc.status.nodes.first();
                if saw_down.is_empty() && node.and_then(|n| n.serving) == Some(false) {
                    saw_down = conditions(doc);
                }
                doc.is_true(ConditionType::Ready) && node.and_then(|n| n.restarts).unwrap_or(0) >= 1
            })
            .await?;
        let took = started.elapsed();
        let traffic = client.tally() - before;
        let node = doc.status.nodes.first();
        let generation = node.and_then(|n| n.generation).unwrap_or_default();
        let exit = node
            .and_then(|n| n.last_exit.as_ref())
            .map_or_else(|| "an unknown way".to_string(), |e| e.describe());
        if !saw_down.is_empty() {
            println!("    status while down: {saw_down}");
        }
        println!(
            "    -> generation {} exited with {exit}; restarted as generation {generation} in {:.1} s; {}; {} requests, {} failed while nothing served\n",
            serving.generation,
            took.as_secs_f64(),
            conditions(&doc),
            traffic.sent,
            traffic.failed,
        );
        let row = Row {
            step: title.to_string(),
            cause: "exit".into(),
            mode: Mode::Overlap,
            outcome: Outcome::Done,
            executed: true,
            drain_ms: None,
            traffic: Some(traffic),
            serving: client.last_build(),
            took,
            restart: true,
        };
        Ok((row, doc))
    }

    /// Writes the manifest and waits until standalone mode has run the
    /// attempt it causes and the plan is quiet.
    async fn step(
        &self,
        number: &str,
        title: &str,
        story: &str,
        desired: &Desired<'_>,
        last_rev: i64,
        client: Option<&Client>,
    ) -> Result<(Row, StatusDocument), DemoError> {
        println!("{number} {title}\n    {story}");
        let before = client.map(Client::tally);
        let started = Instant::now();
        let path = self.manifests.join(MANIFEST);
        let text = desired.manifest();
        tokio::task::spawn_blocking(move || replace_file(&path, text.as_bytes(), 0o644))
            .await
            .map_err(|join| DemoError::Setup {
                what: "write the manifest".into(),
                source: io::Error::other(join.to_string()),
            })?
            .map_err(|source| DemoError::Setup {
                what: "write the manifest".into(),
                source,
            })?;
        let doc = self.wait(title, |doc| settled_after(doc, last_rev)).await?;
        let took = started.elapsed();
        let traffic = client.map(|c| c.tally() - before.unwrap_or_default());
        let last = doc.last_attempt();
        let row = Row {
            step: title.to_string(),
            cause: last.map_or_else(|| "-".into(), |l| format!("{:?}", l.cause).to_lowercase()),
            mode: last.map_or(desired.mode, |l| l.mode),
            outcome: last.map_or(Outcome::Abandoned, |l| l.outcome),
            executed: last.is_some_and(|l| l.executed),
            drain_ms: last.and_then(|l| l.drain_ms),
            traffic,
            serving: client
                .and_then(Client::last_build)
                .or_else(|| doc.status.nodes.first().and_then(|n| n.build.clone())),
            took,
            restart: false,
        };
        println!(
            "    -> {} in {:.1} s; {}{}\n",
            row.outcome.as_str(),
            took.as_secs_f64(),
            conditions(&doc),
            traffic.map_or_else(String::new, |t| format!(
                "; {} requests, {} failed",
                t.sent, t.failed
            )),
        );
        Ok((row, doc))
    }
}

/// The attempt after `last_rev` has an outcome, every attempt has ended,
/// and the instance is not reconciling any more.
fn settled_after(doc: &StatusDocument, last_rev: i64) -> bool {
    doc.last_attempt().is_some_and(|l| l.sched_rev > last_rev)
        && doc.attempts.iter().all(|a| a.status.outcome.is_some())
        && doc
            .condition(ConditionType::Reconciling)
            .is_some_and(|c| c.status == "False")
}

fn newest_rev(doc: &StatusDocument) -> i64 {
    doc.attempts.iter().map(|a| a.sched_rev).max().unwrap_or(0)
}

/// `Ready=True (AllNodesReady), Stalled=False`.
fn conditions(doc: &StatusDocument) -> String {
    [ConditionType::Ready, ConditionType::Stalled]
        .iter()
        .filter_map(|t| doc.condition(*t))
        .map(|c| format!("{}={} ({})", c.type_, c.status, c.reason))
        .collect::<Vec<_>>()
        .join(", ")
}
