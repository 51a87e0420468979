//! One standalone host per test: a manifest directory, a staging root and a
//! state dir in one temp dir, a short run dir beside it, a unique cgroup v2
//! subtree, and standalone
//! mode running over them (stopping every instance on exit). Everything is
//! removed on drop, after a panic too: the subtree is killed and removed by
//! [`TestCgroupTree`], the temp dirs deleted.
//!
//! Include it after the cgroup guard and the swap host:
//! `#[path = "support/cgroup_guard.rs"] mod cgroup_guard;`
//! `#[path = "support/swap_host.rs"] mod swap_host;`
//! `#[path = "standalone_support/mod.rs"] mod standalone_support;`
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use genswap_crds::ConditionType;
use genswap_runtime::prometheus::Prometheus;
use node_agent::engine::EngineConfig;
use node_agent::gate::InstanceKey;
use node_agent::host::{Host, HostSettings};
use node_agent::logs::LogSettings;
use node_agent::standalone::{
    self, NodeIdentity, StandaloneConfig, StandaloneError, StatusDocument,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::cgroup_guard::{TestCgroupTree, instance_pids};
use crate::swap_host::{DEADLINE, Identity, NOBODY, ask, testapp_build};

/// The node name standalone mode runs as in the tests.
pub const NODE: &str = "node-a";

/// A standalone host.
pub struct StandaloneHost {
    /// The manifest directory.
    pub dir: PathBuf,
    /// Artifacts must be under it.
    pub staging: PathBuf,
    pub host: Host,
    stop: Option<oneshot::Sender<()>>,
    runner: Option<Runner>,
    labels: BTreeMap<String, String>,
    tree: TestCgroupTree,
    /// What `start_prepared`'s preparation holds over the state dir (a
    /// mount): released before the temp dir is removed, which it would
    /// otherwise keep from going.
    prepared: Option<Box<dyn Send>>,
    // Dropped after the tree: nothing runs from them by then.
    temp: tempfile::TempDir,
    run: tempfile::TempDir,
    prometheus: Option<Prometheus>,
}

impl StandaloneHost {
    /// Starts standalone mode over a fresh temp dir and cgroup subtree; it
    /// stops every instance when it stops.
    pub fn start(tag: &str) -> StandaloneHost {
        StandaloneHost::start_with(tag, true)
    }

    /// [`StandaloneHost::start`], choosing whether stopping standalone mode
    /// stops the instances.
    pub fn start_with(tag: &str, stop_on_exit: bool) -> StandaloneHost {
        StandaloneHost::start_labelled(tag, stop_on_exit, BTreeMap::new())
    }

    /// [`StandaloneHost::start_with`] on a node with `labels` (besides
    /// `kubernetes.io/hostname`).
    pub fn start_labelled(
        tag: &str,
        stop_on_exit: bool,
        labels: BTreeMap<String, String>,
    ) -> StandaloneHost {
        StandaloneHost::start_prepared(tag, stop_on_exit, labels, |_| None)
    }

    /// [`StandaloneHost::start_labelled`], calling `prepare` with the state
    /// dir's path (not yet made) before standalone mode starts; the store
    /// is kept outside it.
    pub fn start_prepared(
        tag: &str,
        stop_on_exit: bool,
        labels: BTreeMap<String, String>,
        prepare: impl FnOnce(&Path) -> Option<Box<dyn Send>>,
    ) -> StandaloneHost {
        StandaloneHost::start_full(tag, stop_on_exit, labels, prepare, None, Default::default())
    }

    /// [`StandaloneHost::start`] with the node's trust policy
    /// (`--trust-keys`, `--require-signatures`).
    pub fn start_trusting(tag: &str, trust: genswap_store::TrustPolicy) -> StandaloneHost {
        StandaloneHost::start_full(tag, true, BTreeMap::new(), |_| None, None, trust)
    }

    /// [`StandaloneHost::start`], `rollout.analysis` asking the Prometheus
    /// at `prometheus_url`.
    pub fn start_measured(tag: &str, prometheus_url: &str) -> StandaloneHost {
        let prometheus = Prometheus::new(prometheus_url, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{e}"));
        StandaloneHost::start_full(
            tag,
            true,
            BTreeMap::new(),
            |_| None,
            Some(prometheus),
            Default::default(),
        )
    }

    fn start_full(
        tag: &str,
        stop_on_exit: bool,
        labels: BTreeMap<String, String>,
        prepare: impl FnOnce(&Path) -> Option<Box<dyn Send>>,
        prometheus: Option<Prometheus>,
        trust: genswap_store::TrustPolicy,
    ) -> StandaloneHost {
        let temp = tempfile::Builder::new()
            .prefix(&format!("genswap-standalone-{tag}-"))
            .tempdir()
            .expect("temp dir");
        // Instances run as nobody: they must reach the store and the run dir.
        fs::set_permissions(temp.path(), fs::Permissions::from_mode(0o755))
            .expect("open the temp dir to the instance's uid");
        let dir = temp.path().join("manifests");
        let staging = temp.path().join("staging");
        fs::create_dir(&dir).expect("manifest dir");
        fs::create_dir(&staging).expect("staging root");
        let tree = TestCgroupTree::new(tag);
        // A run dir must be short for its sockets; the temp dir's name is not.
        let run = node_agent::sandbox::short_dir("gs-").expect("run dir");
        let prepared = prepare(&temp.path().join("state"));
        let settings = HostSettings {
            cgroup_root: Some(tree.path().join("genswap")),
            run_dir: run.path().to_path_buf(),
            state_dir: temp.path().join("state"),
            staging_root: staging.clone(),
            store_dir: Some(temp.path().join("store")),
            tree_limits: genswap_store::TreeLimits::default(),
            registries: Default::default(),
            trust,
            retention: Default::default(),
            engine: EngineConfig::default(),
            logs: LogSettings::in_dir(
                temp.path().join("logs"),
                env!("CARGO_BIN_EXE_genswap-helper"),
            ),
        };
        let (host, stop, runner) =
            launch(&settings, &dir, stop_on_exit, &labels, prometheus.clone());
        StandaloneHost {
            dir,
            staging,
            host,
            stop: Some(stop),
            runner: Some(runner),
            labels,
            tree,
            prepared,
            temp,
            run,
            prometheus,
        }
    }

    /// Stops standalone mode and starts it again over the same directories,
    /// with a new engine, as a restarted process would. The new run stops
    /// every instance when it stops.
    pub async fn restart(&mut self) {
        self.restart_labelled(self.labels.clone()).await;
    }

    /// [`StandaloneHost::restart`] on a node that now has `labels`.
    pub async fn restart_labelled(&mut self, labels: BTreeMap<String, String>) {
        self.end_runner().await;
        self.relaunch(labels);
    }

    /// [`StandaloneHost::restart`], calling `between` while no run is up
    /// (to change the disk under a stopped agent).
    pub async fn restart_after(&mut self, between: impl FnOnce(&StandaloneHost)) {
        self.end_runner().await;
        between(self);
        self.relaunch(self.labels.clone());
    }

    fn relaunch(&mut self, labels: BTreeMap<String, String>) {
        self.labels = labels;
        let (host, stop, runner) = launch(
            &self.host.settings,
            &self.dir,
            true,
            &self.labels,
            self.prometheus.clone(),
        );
        self.host = host;
        self.stop = Some(stop);
        self.runner = Some(runner);
    }

    async fn end_runner(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runner) = self.runner.take() {
            let ended = tokio::time::timeout(DEADLINE, runner)
                .await
                .expect("standalone mode stops within the deadline")
                .expect("standalone mode did not panic");
            ended.expect("standalone mode ended without an error");
        }
    }

    /// A distinct testapp build in the staging root.
    pub fn build(&self, name: &str) -> testapp::Build {
        testapp_build(&self.staging, name)
    }

    /// Writes `file` the way an operator should: a hidden temp file renamed
    /// into place.
    pub fn write(&self, file: &str, yaml: &str) {
        let temp = self.dir.join(format!(".{file}.tmp"));
        fs::write(&temp, yaml).expect("write the manifest");
        fs::rename(&temp, self.dir.join(file)).expect("move the manifest into place");
    }

    /// Deletes `file`.
    pub fn remove(&self, file: &str) {
        fs::remove_file(self.dir.join(file)).expect("delete the manifest");
    }

    /// Waits until the status of `file` satisfies `accept`.
    pub async fn status(
        &self,
        file: &str,
        what: &str,
        accept: impl FnMut(&StatusDocument) -> bool,
    ) -> StatusDocument {
        match standalone::wait_for_status(&self.dir, file, DEADLINE, accept).await {
            Ok(doc) => doc,
            Err(error) => panic!("waiting for {what}: {error}"),
        }
    }

    /// Waits until `file` has a finished attempt above `rev` and nothing is
    /// in flight any more.
    pub async fn settled_after(&self, file: &str, rev: i64) -> StatusDocument {
        self.status(file, &format!("an attempt after rev {rev} to end"), |doc| {
            doc.last_attempt().is_some_and(|l| l.sched_rev > rev)
                && doc.attempts.iter().all(|a| a.status.outcome.is_some())
                && !doc.is_true(ConditionType::Reconciling)
        })
        .await
    }

    /// The instance's `current.sock`.
    pub fn current_sock(&self, key: &InstanceKey) -> PathBuf {
        self.host.engine.layout().current_socket(key)
    }

    /// Who answers through the instance's `current.sock`.
    pub async fn who_serves(&self, key: &InstanceKey) -> Option<Identity> {
        ask(&self.current_sock(key)).await
    }

    /// The instance's cgroup directory.
    pub fn instance_cgroup(&self, key: &InstanceKey) -> PathBuf {
        self.tree
            .path()
            .join("genswap")
            .join(node_agent::disk_name::DiskName::of(key))
    }

    /// Every pid in the test's cgroup subtree.
    pub fn pids_in_tree(&self) -> Vec<u32> {
        instance_pids(self.tree.path())
    }

    /// The `gen-<N>` cgroups of the instance.
    pub fn generation_cgroups(&self, key: &InstanceKey) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.instance_cgroup(key))
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// The state dir.
    pub fn state_dir(&self) -> &Path {
        &self.host.settings.state_dir
    }

    /// Where standalone mode writes `file`'s status document.
    pub fn status_path(&self, file: &str) -> PathBuf {
        standalone::status_path(&self.dir, file)
    }

    /// Stops standalone mode (which stops every instance) and checks it
    /// ended cleanly with nothing left in the subtree.
    pub async fn stop(mut self) {
        self.end_runner().await;
        assert_eq!(self.pids_in_tree(), Vec::<u32>::new(), "processes left");
        // Stop-on-exit forgets every instance: no state, and no status file
        // that still claims something serves.
        let state: Vec<_> = fs::read_dir(self.state_dir().join("standalone"))
            .expect("the standalone state dir")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .collect();
        assert!(state.is_empty(), "standalone state left: {state:?}");
        for entry in fs::read_dir(self.dir.join("status")).expect("the status dir") {
            let path = entry.expect("a status entry").path();
            let doc = StatusDocument::read(&path).expect("a readable status file");
            assert!(
                doc.error.is_some() && doc.attempts.is_empty(),
                "{} still describes an instance: {doc:?}",
                path.display()
            );
        }
    }
}

impl Drop for StandaloneHost {
    fn drop(&mut self) {
        if let Some(runner) = self.runner.take() {
            runner.abort();
        }
    }
}

type Runner = JoinHandle<Result<(), StandaloneError>>;

/// Builds the host parts from `settings` and runs standalone mode over
/// `dir` until the returned sender fires.
fn launch(
    settings: &HostSettings,
    dir: &Path,
    stop_on_exit: bool,
    labels: &BTreeMap<String, String>,
    prometheus: Option<Prometheus>,
) -> (Host, oneshot::Sender<()>, Runner) {
    let host = Host::build(settings).expect("the host parts");
    let (stop, stopped) = oneshot::channel::<()>();
    let config = StandaloneConfig {
        dir: dir.to_path_buf(),
        node: NodeIdentity::new(NODE, labels.clone()),
        stop_on_exit,
        prometheus,
    };
    let runner = tokio::spawn({
        let host = host.clone();
        async move {
            // As `node-agent standalone` does: adopt what serves first.
            host.engine.recover().await;
            standalone::run(&host, config, async {
                let _ = stopped.await;
            })
            .await
        }
    });
    (host, stop, runner)
}

/// An InstanceGeneration manifest for a testapp build.
#[derive(Clone, Debug)]
pub struct Manifest {
    pub name: String,
    pub namespace: Option<String>,
    pub build_id: String,
    pub path: PathBuf,
    pub sha256: String,
    pub mode: &'static str,
    pub retry: String,
    pub args: Vec<String>,
    /// The process's environment (testapp knobs).
    pub env: Vec<(String, String)>,
    pub health_timeout_seconds: u32,
    /// The labels of the nodes it selects; empty selects every node.
    pub node_selector: BTreeMap<String, String>,
    /// `spec.resources` as a YAML flow mapping, such as `{memoryMax: 64Mi}`.
    pub resources: Option<String>,
    /// `spec.listeners` as a YAML flow sequence.
    pub listeners: Option<String>,
    /// An archive build: its `artifact.unpack` and its `build.entrypoint`.
    pub tree: Option<(&'static str, String)>,
    /// `process.writablePaths`: the test's dirs the instance writes.
    pub writable: Vec<PathBuf>,
    /// `process.root: build`.
    pub root_build: bool,
    /// `health.path`.
    pub health_path: Option<String>,
    /// `process.filesystem: Host` (a script build that runs the test app
    /// from the test's dirs).
    pub host_filesystem: bool,
    /// `spec.rollout` as a YAML flow mapping.
    pub rollout: Option<String>,
    /// `build.signedBy`, and `build.signature` when inline.
    pub signed: Option<(String, Option<String>)>,
}

impl Manifest {
    /// `name` running `build` as build `build_id`: overlap, no settle
    /// window, run as nobody.
    pub fn new(name: &str, build_id: &str, build: &testapp::Build) -> Manifest {
        Manifest {
            name: name.into(),
            namespace: None,
            build_id: build_id.into(),
            path: build.path.clone(),
            sha256: build.sha256.clone(),
            mode: "overlap",
            retry: String::new(),
            args: Vec::new(),
            env: Vec::new(),
            health_timeout_seconds: 20,
            node_selector: BTreeMap::new(),
            resources: None,
            listeners: None,
            tree: None,
            writable: Vec::new(),
            root_build: false,
            health_path: None,
            host_filesystem: false,
            rollout: None,
            signed: None,
        }
    }

    /// The YAML text.
    pub fn yaml(&self) -> String {
        let namespace = self
            .namespace
            .as_ref()
            .map_or_else(String::new, |ns| format!("\n  namespace: {ns}"));
        let args = self
            .args
            .iter()
            .map(|a| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let env = self
            .env
            .iter()
            .map(|(name, value)| format!("{{name: \"{name}\", value: \"{value}\"}}"))
            .collect::<Vec<_>>()
            .join(", ");
        let writable = self
            .writable
            .iter()
            .map(|p| format!("\"{}\"", p.display()))
            .collect::<Vec<_>>()
            .join(", ");
        let node_selector: String = self
            .node_selector
            .iter()
            .map(|(key, value)| format!("\n    {key}: {value}"))
            .collect();
        let node_selector = if node_selector.is_empty() {
            node_selector
        } else {
            format!("\n  nodeSelector:{node_selector}")
        };
        format!(
            "apiVersion: genswap.dev/v1alpha1
kind: InstanceGeneration
metadata:
  name: {name}{namespace}
spec:{node_selector}
  build:
    id: {id}
    artifact:
      path: {path}{unpack}
    sha256: {sha}{entrypoint}{signed}
  mode: {mode}
  retry: \"{retry}\"
  process:
    args: [{args}]
    env: [{env}]
    writablePaths: [{writable}]{root}{filesystem}
    user: {NOBODY}
    group: {NOBODY}
  health:
    timeoutSeconds: {health}{health_path}
  settle:
    seconds: 0
  stop:
    timeoutSeconds: 10
{resources}{listeners}{rollout}",
            filesystem = if self.host_filesystem {
                "\n    filesystem: Host"
            } else {
                ""
            },
            health_path = self
                .health_path
                .as_ref()
                .map_or_else(String::new, |p| format!("\n    path: {p}")),
            signed = match &self.signed {
                None => String::new(),
                Some((key, None)) => format!("\n    signedBy: {key}"),
                Some((key, Some(signature))) => {
                    format!("\n    signedBy: {key}\n    signature: \"{signature}\"")
                }
            },
            rollout = self
                .rollout
                .as_ref()
                .map_or_else(String::new, |r| format!("  rollout: {r}\n")),
            root = if self.root_build {
                "\n    root: build"
            } else {
                ""
            },
            resources = self
                .resources
                .as_ref()
                .map_or_else(String::new, |r| format!("  resources: {r}\n")),
            listeners = self
                .listeners
                .as_ref()
                .map_or_else(String::new, |l| format!("  listeners: {l}\n")),
            unpack = self
                .tree
                .as_ref()
                .map_or_else(String::new, |(format, _)| format!(
                    "\n      unpack: {format}"
                )),
            entrypoint = self
                .tree
                .as_ref()
                .map_or_else(String::new, |(_, entrypoint)| format!(
                    "\n    entrypoint: {entrypoint}"
                )),
            name = self.name,
            id = self.build_id,
            path = self.path.display(),
            sha = self.sha256,
            mode = self.mode,
            retry = self.retry,
            health = self.health_timeout_seconds,
        )
    }
}

/// Labels (or a selector) from pairs.
pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(key, value)| ((*key).into(), (*value).into()))
        .collect()
}

/// The key of an instance in the default namespace.
pub fn key(name: &str) -> InstanceKey {
    InstanceKey::new("default", name).expect("an instance key")
}

/// Requests through a socket without a pause, one new connection each,
/// counting what was sent and what failed.
pub struct Client {
    pub sent: Arc<AtomicU64>,
    pub failed: Arc<AtomicU64>,
    running: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Client {
    pub fn start(socket: PathBuf) -> Client {
        let sent = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let running = Arc::new(AtomicBool::new(true));
        let task = tokio::spawn({
            let (sent, failed, running) = (sent.clone(), failed.clone(), running.clone());
            async move {
                while running.load(Ordering::SeqCst) {
                    sent.fetch_add(1, Ordering::SeqCst);
                    match node_agent::health::get_within(&socket, "/", Duration::from_secs(5)).await
                    {
                        Ok((200, _)) => {}
                        _ => {
                            failed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        });
        Client {
            sent,
            failed,
            running,
            task,
        }
    }

    /// Stops after the request in flight; returns (sent, failed).
    pub async fn finish(self) -> (u64, u64) {
        self.running.store(false, Ordering::SeqCst);
        let task = self.task;
        let _ = tokio::time::timeout(DEADLINE, task).await;
        (
            self.sent.load(Ordering::SeqCst),
            self.failed.load(Ordering::SeqCst),
        )
    }
}
