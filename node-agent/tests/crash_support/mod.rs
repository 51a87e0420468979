//! One standalone host driven by real `node-agent standalone` processes, for
//! the kill tests: a manifest directory, a staging root, run and state dirs
//! in one temp dir, a unique cgroup v2 subtree, and agents started, stopped
//! dead (SIGKILL, or a crash point's abort) and restarted over them.
//!
//! Every agent writes its log (JSON lines, with the instances' own output
//! and a paused crash point's line) to its own file. Everything is removed
//! on drop, after a panic too: an agent still running is killed by pid,
//! the subtree is killed and removed by [`TestCgroupTree`], the temp dir
//! deleted.
//!
//! Include it after the cgroup guard and the swap host:
//! `#[path = "support/cgroup_guard.rs"] mod cgroup_guard;`
//! `#[path = "support/swap_host.rs"] mod swap_host;`
//! `#[path = "crash_support/mod.rs"] mod crash_support;`
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use genswap_crds::ConditionType;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use node_agent::failpoint::{CRASH_AT_ENV, CRASH_HOW_ENV, PAUSED_PREFIX};
use node_agent::gate::InstanceKey;
use node_agent::journal::Journal;
use node_agent::standalone::state::StateStore;
use node_agent::standalone::{StatusDocument, wait_for_status};
use node_agent::switch::{CURRENT_SOCKET, RunLayout, current_generation};
use tokio::task::JoinHandle;

use crate::cgroup_guard::{TestCgroupTree, instance_pids};
use crate::swap_host::{Identity, NOBODY, ask, testapp_build};

/// The manifest file every kill test writes.
pub const FILE: &str = "app.yaml";
/// Generous: agents start, recover and retry (an abandoned attempt is
/// re-issued after 5 s) on a shared 2-core machine.
pub const DEADLINE: Duration = Duration::from_secs(90);

/// How a started agent is to die.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crash {
    /// It runs until the test stops it.
    No,
    /// At this crash point it stops the thread and says so; the test then
    /// SIGKILLs it.
    PauseAt(&'static str),
    /// At this crash point it aborts.
    AbortAt(&'static str),
}

/// The host.
pub struct Node {
    /// The manifest directory.
    pub dir: PathBuf,
    pub staging: PathBuf,
    pub run_dir: PathBuf,
    pub state_dir: PathBuf,
    /// The one instance, `default/app`.
    pub key: InstanceKey,
    runs: AtomicU64,
    tree: TestCgroupTree,
    // Dropped after the tree: nothing runs from them by then.
    temp: tempfile::TempDir,
    run: tempfile::TempDir,
}

impl Node {
    pub fn new(tag: &str) -> Node {
        let temp = tempfile::Builder::new()
            .prefix(&format!("genswap-crash-{tag}-"))
            .tempdir()
            .expect("temp dir");
        // Instances run as nobody: they must reach the store and the run dir.
        fs::set_permissions(temp.path(), fs::Permissions::from_mode(0o755))
            .expect("open the temp dir to the instance's uid");
        let dir = temp.path().join("manifests");
        let staging = temp.path().join("staging");
        fs::create_dir(&dir).expect("manifest dir");
        // Made here so the status can be watched before the first agent
        // runs (the agent keeps an existing one).
        fs::create_dir(dir.join(node_agent::standalone::STATUS_SUBDIR)).expect("status dir");
        fs::create_dir(&staging).expect("staging root");
        // A run dir must be short for its sockets; the temp dir's name is not.
        let run = node_agent::sandbox::short_dir("gs-").expect("run dir");
        Node {
            dir,
            staging,
            run_dir: run.path().to_path_buf(),
            state_dir: temp.path().join("state"),
            key: InstanceKey::new("default", "app").expect("instance key"),
            runs: AtomicU64::new(0),
            tree: TestCgroupTree::new(tag),
            temp,
            run,
        }
    }

    /// The test's cgroup subtree (the agent's root is `<it>/genswap`).
    pub fn tree_path(&self) -> &Path {
        self.tree.path()
    }

    /// Where a case's sidecars report (see `support/sidecar_report.rs`).
    pub fn sidecar_dir(&self) -> PathBuf {
        self.temp.path().join("sidecars")
    }

    /// The cgroup v2 mount the subtree lies in.
    pub fn cgroup_mount(&self) -> &Path {
        self.tree.mount()
    }

    /// The agent's `--cgroup-root`.
    pub fn cgroup_root(&self) -> PathBuf {
        self.tree.path().join("genswap")
    }

    /// The pids of the instance's listener keepers.
    pub fn keeper_pids(&self) -> Vec<u32> {
        let dir = self
            .cgroup_root()
            .join(node_agent::cgroup::KEEPER_CGROUP)
            .join(node_agent::disk_name::DiskName::of(&self.key).as_str());
        fs::read_to_string(dir.join("cgroup.procs"))
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// The instance's cgroup directory.
    pub fn instance_cgroup(&self) -> PathBuf {
        self.cgroup_root()
            .join(node_agent::disk_name::DiskName::of(&self.key))
    }

    /// The instance's `current.sock`.
    pub fn current_sock(&self) -> PathBuf {
        RunLayout::new(&self.run_dir).current_socket(&self.key)
    }

    /// A distinct testapp build in the staging root.
    pub fn build(&self, name: &str) -> testapp::Build {
        testapp_build(&self.staging, name)
    }

    /// Writes the manifest the way an operator should: a hidden temp file
    /// renamed into place.
    pub fn write(&self, manifest: &Manifest) {
        let temp = self.dir.join(format!(".{FILE}.tmp"));
        fs::write(&temp, manifest.yaml()).expect("write the manifest");
        fs::rename(&temp, self.dir.join(FILE)).expect("move the manifest into place");
    }

    /// Starts `node-agent standalone` over this host.
    pub fn start(&self, crash: Crash) -> Agent {
        self.start_as(Command::new(env!("CARGO_BIN_EXE_node-agent")), crash, &[])
    }

    /// Starts it as a DaemonSet pod's container runs: in the cgroup `pod`,
    /// in new mount and cgroup namespaces (the pod's cgroup their root, and
    /// cgroup2 mounted again at `mount` to show only it), sharing the PID
    /// namespace (hostPID). With `join` it joins PID 1's namespaces as the
    /// DaemonSet's agent does.
    pub fn start_in_pod(&self, pod: &Path, mount: &Path, join: bool) -> Agent {
        fs::create_dir_all(pod).expect("the pod's cgroup");
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(
                r#"echo $$ > "$1/cgroup.procs" && shift && exec /usr/bin/unshare --mount --cgroup --fork -- /bin/sh -c '/usr/bin/umount "$0" && /usr/bin/mount -t cgroup2 cgroup2 "$0" && exec "$@"' "$@""#,
            )
            .arg("sh")
            .arg(pod)
            .arg(mount)
            .arg(env!("CARGO_BIN_EXE_node-agent"));
        let joining: &[&str] = if join {
            &["--join-host-namespaces"]
        } else {
            &[]
        };
        self.start_as(command, Crash::No, joining)
    }

    /// Starts it as a DaemonSet pod's container runs on a hybrid host: first
    /// moved into the pod's cgroup of each v1 hierarchy in `pod_v1_cgroups`
    /// (directories), as runc places a container, then exec'd.
    pub fn start_in_v1_pod(&self, pod_v1_cgroups: &[PathBuf]) -> Agent {
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(r#"while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 1; shift; done; shift; exec "$@""#)
            .arg("sh")
            .args(pod_v1_cgroups)
            .arg("--")
            .arg(env!("CARGO_BIN_EXE_node-agent"));
        self.start_as(command, Crash::No, &[])
    }

    fn start_as(&self, mut command: Command, crash: Crash, extra: &[&str]) -> Agent {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let log = self.temp.path().join(format!("agent-{run}.log"));
        let file = fs::File::create(&log).expect("the agent's log file");
        command
            .arg("standalone")
            .arg("--dir")
            .arg(&self.dir)
            .args(["--node-name", "node-a", "--log-format", "json"])
            .arg("--cgroup-root")
            .arg(self.cgroup_root())
            .arg("--run-dir")
            .arg(&self.run_dir)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--staging-root")
            .arg(&self.staging)
            .arg("--log-dir")
            .arg(self.temp.path().join("logs"))
            .args(extra)
            // Nothing from the test's environment steers the agent.
            .env_clear()
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("clone the log file"))
            .stderr(file);
        match crash {
            Crash::No => {}
            Crash::PauseAt(point) => {
                command.env(CRASH_AT_ENV, point).env(CRASH_HOW_ENV, "pause");
            }
            Crash::AbortAt(point) => {
                command.env(CRASH_AT_ENV, point);
            }
        }
        let child = command.spawn().expect("start node-agent standalone");
        Agent {
            child: Some(child),
            log,
        }
    }

    /// Waits until the status file satisfies `accept`.
    pub async fn status(
        &self,
        what: &str,
        accept: impl FnMut(&StatusDocument) -> bool,
    ) -> StatusDocument {
        match wait_for_status(&self.dir, FILE, DEADLINE, accept).await {
            Ok(doc) => doc,
            Err(error) => panic!("waiting for {what}: {error}"),
        }
    }

    /// Waits until standalone mode's own state file lists the attempt of
    /// `sched_rev`: its bookkeeping has caught up with the engine.
    pub async fn wait_state_lists(&self, sched_rev: i64) {
        let store = StateStore::open(&self.state_dir).expect("the standalone state store");
        poll("the standalone state to list the attempt", || {
            store.load_all().is_ok_and(|(states, _)| {
                states.iter().any(|state| {
                    state.instance == self.key
                        && state.attempts.iter().any(|a| a.spec.sched_rev == sched_rev)
                })
            })
        })
        .await;
    }

    /// Who answers through `current.sock`.
    pub async fn who_serves(&self) -> Option<Identity> {
        ask(&self.current_sock()).await
    }

    /// Every pid in the test's cgroup subtree.
    pub fn pids_in_tree(&self) -> Vec<u32> {
        instance_pids(self.tree.path())
    }

    /// Asserts the end state of a recovery: exactly one generation of
    /// `build` serving through `current.sock` (or nothing at all), only its
    /// cgroup, socket and processes left under the subtree and in the run
    /// dir, and a journal that holds no outcome, no attempt in flight, no
    /// temp or quarantined file.
    pub async fn assert_clean(&self, build: Option<&str>) {
        // The agent's own cgroups stay (the log shims', the listener
        // keepers'): they are the node's, not an instance's.
        let root_children: Vec<String> = dir_names(&self.cgroup_root())
            .into_iter()
            .filter(|name| !node_agent::cgroup::is_agent_cgroup(name.as_ref()))
            .collect();
        let generations = dir_names(&self.instance_cgroup());
        let run_files = dir_names(&RunLayout::new(&self.run_dir).instance_dir(&self.key));
        let identity = self.who_serves().await;
        let serving = match build {
            Some(build) => {
                let identity = identity.expect("a generation answers through current.sock");
                assert_eq!(identity.build, build, "the build that serves");
                let n = identity.generation;
                assert_eq!(
                    root_children,
                    vec![self.key.to_string()],
                    "cgroups under the root"
                );
                assert_eq!(
                    generations,
                    vec![format!("gen-{n}")],
                    "only the serving generation's cgroup is left"
                );
                assert_eq!(
                    run_files,
                    vec![
                        CURRENT_SOCKET.to_string(),
                        format!("gen-{n}.private"),
                        format!("gen-{n}.sock")
                    ],
                    "only the serving generation's socket, its private /tmp and current.sock are left"
                );
                assert_eq!(
                    current_generation(&RunLayout::new(&self.run_dir).instance_dir(&self.key)),
                    Some(n)
                );
                let inside = instance_pids(&self.instance_cgroup().join(format!("gen-{n}")));
                assert!(!inside.is_empty(), "generation {n} runs no process");
                assert_eq!(
                    self.pids_in_tree(),
                    inside,
                    "no process outside the serving generation's cgroup"
                );
                Some(n)
            }
            None => {
                assert_eq!(identity, None, "nothing answers through current.sock");
                assert!(
                    generations.is_empty(),
                    "generation cgroups left: {generations:?}"
                );
                assert!(
                    run_files.is_empty(),
                    "sockets or links left in the run dir: {run_files:?}"
                );
                assert_eq!(self.pids_in_tree(), Vec::<u32>::new(), "processes left");
                None
            }
        };
        // The adapter acknowledges right after writing the status file.
        let journal = Journal::open(&self.state_dir).expect("the journal");
        let mut last = String::new();
        let clean = poll_until(DEADLINE, || {
            let (entries, corrupt) = journal.load_all().expect("read the journal");
            let entry = entries.iter().find(|e| e.instance == self.key);
            last = format!("{entries:?} {corrupt:?}");
            corrupt.is_empty()
                && entry.is_some_and(|entry| {
                    entry.attempt.is_none()
                        && entry.unreported.is_empty()
                        && entry.serving.as_ref().map(|g| g.n) == serving
                })
        })
        .await;
        assert!(clean, "the journal is not clean: {last}");
        let leftovers: Vec<String> = dir_names(journal.dir())
            .into_iter()
            .filter(|name| name.contains(".tmp-") || name.contains(".corrupt-"))
            .collect();
        assert!(leftovers.is_empty(), "journal leftovers: {leftovers:?}");
    }
}

/// A running (or dead) agent process.
pub struct Agent {
    child: Option<Child>,
    /// Its log file.
    pub log: PathBuf,
}

impl Agent {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Waits until the agent says it paused at `point`.
    pub async fn wait_paused(&mut self, point: &str) {
        let line = format!("{PAUSED_PREFIX}{point}");
        let log = self.log.clone();
        let mut exited = None;
        let found = poll_until(DEADLINE, || {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                exited = Some(status);
                return true;
            }
            fs::read_to_string(&log).is_ok_and(|text| text.lines().any(|l| l == line))
        })
        .await;
        assert!(
            found && exited.is_none(),
            "the agent did not pause at {point} (exit: {exited:?}); its log:\n{}",
            self.log_text()
        );
    }

    /// SIGKILL, and the exit reaped.
    pub fn kill(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("a running agent");
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("a pid"));
        let _ = kill(pid, Signal::SIGKILL);
        child.wait().expect("reap the killed agent")
    }

    /// Waits for the agent to exit by itself (a crash point's abort); one
    /// that does not is killed, and the panic carries its log.
    pub async fn exited(&mut self) -> ExitStatus {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let child = self.child.as_mut().expect("an agent");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return status;
            }
            if tokio::time::Instant::now() >= deadline {
                self.kill();
                panic!(
                    "the agent did not exit within {DEADLINE:?}; its log:\n{}",
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, and waits for the agent to end (serving generations keep
    /// running). It ends cleanly, or, when the signal came before standalone
    /// mode listens for it (during start-up), by the signal's default action:
    /// a crash like any other, which the next start recovers.
    pub async fn terminate(&mut self) -> ExitStatus {
        let pid = Pid::from_raw(i32::try_from(self.pid()).expect("a pid"));
        kill(pid, Signal::SIGTERM).expect("signal the agent");
        let status = self.exited().await;
        assert!(
            status.success() || status.signal() == Some(Signal::SIGTERM as i32),
            "the agent ended with {status}; its log:\n{}",
            self.log_text()
        );
        status
    }

    /// Waits until the agent has run crash recovery.
    pub async fn wait_recovered(&self) {
        let log = self.log.clone();
        poll("the agent's crash recovery", || {
            fs::read_to_string(&log).is_ok_and(|text| text.contains("crash recovery done"))
        })
        .await;
    }

    /// Its log.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The JSON log lines whose message is `message`.
    pub fn logged(&self, message: &str) -> Vec<serde_json::Value> {
        self.log_text()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| line["fields"]["message"] == message)
            .collect()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take()
            && matches!(child.try_wait(), Ok(None))
        {
            if let Ok(pid) = i32::try_from(child.id()) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            let _ = child.wait();
        }
    }
}

/// An InstanceGeneration manifest for a testapp build.
#[derive(Clone, Debug)]
pub struct Manifest {
    pub build_id: String,
    pub path: PathBuf,
    pub sha256: String,
    /// `overlap` or `hold`.
    pub mode: &'static str,
    /// Every attempt is watched this long after it is healthy.
    pub settle_seconds: u32,
    /// `spec.resources` as a YAML flow mapping, such as `{memoryMax: 96Mi}`.
    pub resources: Option<String>,
    /// A TCP listener `web` on this 127.0.0.1 port.
    pub listener_port: Option<u16>,
    /// The listener on `listener_port` is UDP, named `dns`.
    pub listener_udp: bool,
    /// A sidecar `watcher` (the testapp in its sidecar mode) reporting to
    /// this file.
    pub sidecar_report: Option<PathBuf>,
}

impl Manifest {
    pub fn new(build_id: &str, build: &testapp::Build, mode: &'static str) -> Manifest {
        Manifest {
            build_id: build_id.into(),
            path: build.path.clone(),
            sha256: build.sha256.clone(),
            mode,
            settle_seconds: 1,
            resources: None,
            listener_port: None,
            listener_udp: false,
            sidecar_report: None,
        }
    }

    /// Without `rollout.prestage`: the crash points are the swap's, and
    /// the release is revision 2. (A stage-only ask has no crash points:
    /// nothing of it is journaled or runs, and one without an outcome is
    /// staged again by the next agent.)
    pub fn yaml(&self) -> String {
        format!(
            "apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata:
  name: app
spec:
  build:
    id: {id}
    artifact:
      path: {path}
    sha256: {sha}
  mode: {mode}
  process:
    user: {NOBODY}
    group: {NOBODY}
{writable}  health:
    timeoutSeconds: 20
  settle:
    seconds: {settle}
    allNodes: true
  stop:
    timeoutSeconds: 10
  rollout:
    prestage: false
{resources}{listeners}{sidecars}",
            resources = self
                .resources
                .as_ref()
                .map_or_else(String::new, |r| format!("  resources: {r}\n")),
            listeners = self.listener_port.map_or_else(String::new, |port| {
                let (name, protocol) = if self.listener_udp {
                    ("dns", "udp")
                } else {
                    ("web", "tcp")
                };
                format!("  listeners: [{{name: {name}, {protocol}: \"127.0.0.1:{port}\"}}]\n")
            }),
            sidecars = self.sidecar_report.as_ref().map_or_else(String::new, |report| {
                format!(
                    "  sidecars: [{{name: watcher, process: {{args: [\"--sidecar-report={}\"]}}}}]\n",
                    report.display()
                )
            }),
            // Its sidecar writes its report through the sandbox.
            writable = self
                .sidecar_report
                .as_ref()
                .and_then(|report| report.parent())
                .map_or_else(String::new, |dir| {
                    format!("    writablePaths: [\"{}\"]\n", dir.display())
                }),
            id = self.build_id,
            path = self.path.display(),
            sha = self.sha256,
            mode = self.mode,
            settle = self.settle_seconds,
        )
    }
}

/// The status is quiet: every attempt has an outcome and nothing is being
/// reconciled.
pub fn quiet(doc: &StatusDocument) -> bool {
    !doc.attempts.is_empty()
        && doc.attempts.iter().all(|a| a.status.outcome.is_some())
        && !doc.is_true(ConditionType::Reconciling)
}

/// Requests through `current.sock` without a pause, a new connection each,
/// keeping every failure with when it happened.
pub struct Client {
    sent: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    running: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Client {
    pub fn start(socket: PathBuf) -> Client {
        let sent = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let running = Arc::new(AtomicBool::new(true));
        let started = Instant::now();
        let task = tokio::spawn({
            let (sent, failures, running) = (sent.clone(), failures.clone(), running.clone());
            async move {
                while running.load(Ordering::SeqCst) {
                    sent.fetch_add(1, Ordering::SeqCst);
                    let answer =
                        node_agent::health::get_within(&socket, "/", Duration::from_secs(10)).await;
                    let failure = match answer {
                        Ok((200, _)) => None,
                        Ok((status, _)) => Some(format!("status {status}")),
                        Err(error) => Some(error.to_string()),
                    };
                    if let Some(failure) = failure {
                        failures
                            .lock()
                            .expect("failure list")
                            .push(format!("{:?}: {failure}", started.elapsed()));
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        });
        Client {
            sent,
            failures,
            running,
            task,
        }
    }

    /// Stops after the request in flight; returns how many were sent and
    /// every failure.
    pub async fn finish(self) -> (u64, Vec<String>) {
        self.running.store(false, Ordering::SeqCst);
        let _ = tokio::time::timeout(DEADLINE, self.task).await;
        let failures = self.failures.lock().expect("failure list").clone();
        (self.sent.load(Ordering::SeqCst), failures)
    }
}

/// Polls `condition` until it holds; fails the test after [`DEADLINE`].
pub async fn poll(what: &str, condition: impl FnMut() -> bool) {
    assert!(
        poll_until(DEADLINE, condition).await,
        "timed out waiting for {what}"
    );
}

/// Polls `condition` until it holds or `timeout` passes; whether it held.
pub async fn poll_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The names in `dir` (directories only for a cgroup dir, since its
/// interface files are not what is asked about), sorted; empty when
/// missing.
fn dir_names(dir: &Path) -> Vec<String> {
    let cgroup = dir.join("cgroup.procs").exists();
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| !cgroup || e.file_type().is_ok_and(|t| t.is_dir()))
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}
