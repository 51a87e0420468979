//! The e2e harness: which cluster, the host requirements, building and
//! running the binaries under the right credentials, and cleaning up after
//! them whatever happens (Drop guards: processes by PID, the cgroup subtree
//! by path, the namespace by name, the temp dir).
//!
//! The cluster is, in this order: a real control plane of the suite's own
//! (`test_cluster`, from `../shared/kube`), with the chart installed by
//! helm and the controller and the agents run under its ServiceAccounts'
//! tokens (the agents' bound to their Node), so RBAC and the admission
//! policy are the chart's; else the cluster `KUBECONFIG` names, with its
//! credentials; else none, and the tests print [`SKIP_LINE`] and pass.

#![allow(dead_code)] // Each test binary uses its own part of this module.

use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use kube::config::{Config, KubeConfigOptions};
use serde_json::json;
pub use test_cluster::process::ChildGuard;
use test_cluster::{ControlPlane, chart::ChartRelease};

/// The line printed, and the only output, when there is no cluster.
pub const SKIP_LINE: &str =
    "e2e: skipped: no real control plane (../shared/kube) and no reachable cluster in KUBECONFIG";

/// How long a single API request or reachability probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The uid/gid instances run as (nobody).
pub const INSTANCE_ID: i64 = 65534;

/// The release namespace of the chart the suite installs.
const CHART_NAMESPACE: &str = "genswap-system";

/// Where the suite runs.
pub struct Cluster {
    /// The suite's own control plane, with the chart installed.
    own: Option<(&'static ControlPlane, &'static ChartRelease<'static>)>,
    /// The admin kubeconfig, for kubectl; `None`: the environment's.
    kubeconfig: Option<PathBuf>,
}

impl Cluster {
    /// The suite's control plane, else the cluster in `KUBECONFIG`; `None`
    /// (having printed [`SKIP_LINE`] and why) when there is neither.
    pub async fn find() -> Option<Cluster> {
        if ControlPlane::can_start() || std::env::var("GENSWAP_KUBE").as_deref() == Ok("required") {
            let plane = ControlPlane::shared()?;
            static CHART: OnceLock<ChartRelease<'static>> = OnceLock::new();
            let chart =
                CHART.get_or_init(|| ChartRelease::install(plane, "genswap", CHART_NAMESPACE, &[]));
            return Some(Cluster {
                own: Some((plane, chart)),
                kubeconfig: Some(plane.kubeconfig().to_path_buf()),
            });
        }
        match reachable_kubeconfig().await {
            Ok(()) => Some(Cluster {
                own: None,
                kubeconfig: None,
            }),
            Err(why) => {
                println!("{SKIP_LINE} ({why})");
                None
            }
        }
    }

    /// A client with the admin (or the user's) credentials.
    pub async fn client(&self) -> Client {
        match &self.kubeconfig {
            Some(path) => test_cluster::client_for(path).await,
            None => {
                let config = Config::from_kubeconfig(&KubeConfigOptions::default())
                    .await
                    .expect("the kubeconfig in KUBECONFIG");
                Client::try_from(config).expect("a client")
            }
        }
    }

    /// `kubectl` with the admin (or the user's) credentials.
    pub fn kubectl_command(&self) -> Command {
        let mut command = Command::new("kubectl");
        if let Some(path) = &self.kubeconfig {
            command.env("KUBECONFIG", path);
        }
        command
    }

    /// Runs kubectl, panicking with its output when it fails.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let output = self
            .kubectl_command()
            .args(args)
            .output()
            .expect("run kubectl");
        assert!(
            output.status.success(),
            "kubectl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The suite's own control plane, when it runs on one.
    pub fn own(&self) -> Option<&'static ControlPlane> {
        self.own.map(|(plane, _)| plane)
    }

    /// The namespace the controller's Lease lives in.
    pub fn lease_namespace<'a>(&self, namespace: &'a str) -> &'a str {
        match self.own {
            Some(_) => CHART_NAMESPACE,
            None => namespace,
        }
    }

    /// The Node the suite's agent acts as. On its own control plane, a new
    /// one (`e2e-<tag>-<unique>`); on a cluster, `GENSWAP_E2E_NODE` or the
    /// first Ready one.
    pub async fn node(&self, tag: &str) -> Node {
        self.node_with(tag, &[]).await
    }

    /// [`Cluster::node`], labelled with `labels` on the suite's own control
    /// plane (a cluster's node is taken as it is).
    pub async fn node_with(&self, tag: &str, labels: &[(&str, &str)]) -> Node {
        match self.own {
            Some((plane, _)) => {
                plane
                    .create_node(&format!("e2e-{tag}-{}", unique()), labels)
                    .await
            }
            None => pick_node(&self.client().await).await,
        }
    }

    /// `genswap-controller` for `namespace`, as replica `identity` of the
    /// Lease `lease`.
    pub fn controller_command(&self, namespace: &str, lease: &str, identity: &str) -> Command {
        let mut command = Command::new(&build_binaries().controller);
        command
            .args([
                "--namespace",
                namespace,
                "--identity",
                identity,
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(self.controller_args(namespace, lease));
        command
    }

    /// The controller's credentials and Lease: the chart's ServiceAccount
    /// and release namespace, or the user's credentials and `namespace`.
    fn controller_args(&self, namespace: &str, lease: &str) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec!["--lease-name".into(), lease.into()];
        match self.own {
            Some((_, chart)) => {
                args.extend([
                    "--kubeconfig".into(),
                    chart.controller_kubeconfig().into(),
                    "--lease-namespace".into(),
                    CHART_NAMESPACE.into(),
                ]);
            }
            None => {
                args.extend(["--lease-namespace".into(), namespace.into()]);
                if let Some(path) = single_kubeconfig() {
                    args.extend(["--kubeconfig".into(), path.into()]);
                }
            }
        }
        args
    }

    /// The agent's credentials: a token of the chart's ServiceAccount
    /// bound to `node`, or the user's.
    pub fn agent_args(&self, node: &Node) -> Vec<OsString> {
        let kubeconfig = match self.own {
            Some((_, chart)) => Some(chart.agent_kubeconfig(node)),
            None => single_kubeconfig(),
        };
        kubeconfig
            .map(|path| vec!["--kubeconfig".into(), path.into()])
            .unwrap_or_default()
    }

    /// Creates a namespace of the suite's own; deleted when the guard drops.
    pub async fn namespace(&self, tag: &str) -> NamespaceGuard {
        let name = format!("genswap-e2e-{tag}-{}", unique());
        let namespaces: Api<Namespace> = Api::all(self.client().await);
        let namespace: Namespace = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"genswap.dev/e2e": "true"}}
        }))
        .expect("a Namespace");
        namespaces
            .create(&PostParams::default(), &namespace)
            .await
            .unwrap_or_else(|e| panic!("create the namespace {name}: {e}"));
        NamespaceGuard {
            name,
            kubeconfig: self.kubeconfig.clone(),
        }
    }
}

/// A name part unique to this process and moment.
pub fn unique() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default()
    )
}

/// Whether the cluster `KUBECONFIG` names answers, or why not.
async fn reachable_kubeconfig() -> Result<(), String> {
    let kubeconfig = std::env::var("KUBECONFIG").unwrap_or_default();
    if kubeconfig.trim().is_empty() {
        return Err("KUBECONFIG is not set".into());
    }
    let config = tokio::time::timeout(
        PROBE_TIMEOUT,
        Config::from_kubeconfig(&KubeConfigOptions::default()),
    )
    .await
    .map_err(|_| format!("reading {kubeconfig} took over {PROBE_TIMEOUT:?}"))?
    .map_err(|e| format!("{kubeconfig}: {e}"))?;
    let client = Client::try_from(config).map_err(|e| format!("client: {e}"))?;
    tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version())
        .await
        .map_err(|_| format!("the API server did not answer within {PROBE_TIMEOUT:?}"))?
        .map_err(|e| format!("the API server: {e}"))?;
    Ok(())
}

/// The single kubeconfig file `KUBECONFIG` names, when it names one.
fn single_kubeconfig() -> Option<PathBuf> {
    let value = std::env::var("KUBECONFIG").ok()?;
    (!value.contains(':') && !value.is_empty()).then(|| PathBuf::from(value))
}

/// `GENSWAP_E2E_NODE`, else the first Ready node.
async fn pick_node(client: &Client) -> Node {
    let nodes: Api<Node> = Api::all(client.clone());
    if let Ok(name) = std::env::var("GENSWAP_E2E_NODE") {
        return nodes
            .get(&name)
            .await
            .unwrap_or_else(|e| panic!("GENSWAP_E2E_NODE={name}: {e}"));
    }
    let list = nodes
        .list(&ListParams::default())
        .await
        .expect("list the cluster's nodes");
    list.items
        .into_iter()
        .find(|node| {
            node.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|conditions| {
                    conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                })
        })
        .expect("the cluster has a Ready node (or set GENSWAP_E2E_NODE to a Node's name)")
}

/// What the agent needs from the machine running the suite: root, a
/// writable cgroup v2 mount, and kubectl. Returns the cgroup v2 mount.
pub fn host_requirements() -> PathBuf {
    assert!(
        nix::unistd::geteuid().is_root(),
        "e2e: a cluster is reachable, but the node agent runs here as a local process and needs root (it creates cgroups and starts instances as another uid): run the suite as root, or unset KUBECONFIG"
    );
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").expect("read /proc/self/mountinfo");
    let mount = mountinfo
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            (right.split_whitespace().next() == Some("cgroup2"))
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))
                .flatten()
        })
        .expect(
            "e2e: a cluster is reachable, but this machine has no cgroup v2 mount; the node agent runs here and needs one (a cgroup v2 host: see docs/INSTALL.md)",
        );
    let status = Command::new("kubectl")
        .args(["version", "--client"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    assert!(
        status.is_ok_and(|s| s.success()),
        "e2e: kubectl is not on PATH"
    );
    mount
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    test_cluster::workspace()
}

/// The built binaries the suite runs.
pub struct Binaries {
    /// `genswap-controller`.
    pub controller: PathBuf,
    /// `node-agent`.
    pub agent: PathBuf,
    /// The directory holding `kubectl-genswap`, for kubectl's plugin PATH.
    pub bin_dir: PathBuf,
}

/// Builds the controller, the agent and the test app into the cargo target
/// directory and profile this test binary runs from (so
/// `testapp::make_build` finds the test app beside it); once per binary.
pub fn build_binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        // <target>/<profile>/deps/<test binary>
        let profile_dir = exe
            .ancestors()
            .nth(2)
            .expect("the test binary lies in <target>/<profile>/deps")
            .to_path_buf();
        let target = profile_dir.parent().expect("<target>").to_path_buf();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut command = Command::new(cargo);
        command
            .args([
                "build",
                "--bins",
                "-p",
                "controller",
                "-p",
                "node-agent",
                "-p",
                "testapp",
                "-p",
                "kubectl-genswap",
            ])
            .arg("--manifest-path")
            .arg(workspace().join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", &target);
        if profile_dir
            .file_name()
            .is_some_and(|name| name == "release")
        {
            command.arg("--release");
        }
        let status = command.status().expect("run cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
        Binaries {
            controller: profile_dir.join("genswap-controller"),
            agent: profile_dir.join("node-agent"),
            bin_dir: profile_dir.clone(),
        }
    })
}

/// One node's worth of genswap, run here: a controller and an agent as
/// local processes under the cluster's credentials, both limited to a
/// namespace of their own; the agent acts as a Node of the cluster, runs
/// its instances in a cgroup subtree of its own and stages builds from a
/// temp dir. Fields drop in order: agent, controller, namespace, cgroups,
/// dirs.
pub struct Stack {
    pub agent: ChildGuard,
    pub controller: ChildGuard,
    pub namespace: NamespaceGuard,
    pub cgroups: CgroupGuard,
    /// The Node's `kubernetes.io/hostname` label.
    pub hostname: String,
    pub node_name: String,
    pub staging: PathBuf,
    pub run_dir: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Stack {
    /// Starts the controller and the agent for a new namespace and Node,
    /// both named after `tag`.
    pub async fn start(cluster: &Cluster, tag: &str) -> Stack {
        Stack::start_with(cluster, tag, Vec::new()).await
    }

    /// [`Stack::start`], the agent given `extra` flags too.
    pub async fn start_with(cluster: &Cluster, tag: &str, extra: Vec<OsString>) -> Stack {
        Stack::start_full(cluster, tag, extra, Vec::new(), &[]).await
    }

    /// [`Stack::start`], the agent given `extra` flags, the controller
    /// `controller_extra`, and the Node `labels`.
    pub async fn start_full(
        cluster: &Cluster,
        tag: &str,
        extra: Vec<OsString>,
        controller_extra: Vec<OsString>,
        labels: &[(&str, &str)],
    ) -> Stack {
        let cgroup_mount = host_requirements();
        let node = cluster.node_with(tag, labels).await;
        let hostname = node
            .metadata
            .labels
            .as_ref()
            .and_then(|labels| labels.get("kubernetes.io/hostname"))
            .cloned()
            .expect("the node has a kubernetes.io/hostname label");
        let node_name = node.metadata.name.clone().expect("a node name");
        let dir = host_dir();
        let run_dir = dir.path().join("run");
        let staging = dir.path().join("staging");
        fs::create_dir_all(&staging).expect("create the staging root");
        let cgroups =
            CgroupGuard::create(&cgroup_mount, &format!("genswap-e2e-{tag}-{}", unique()));
        let namespace = cluster.namespace(tag).await;

        let mut controller_cmd = cluster.controller_command(
            &namespace.name,
            &format!("genswap-e2e-{tag}"),
            &format!("genswap-e2e-controller-{tag}"),
        );
        controller_cmd.args(controller_extra);
        let mut agent_cmd = agent_command(cluster, &node, &namespace.name, &cgroups, dir.path());
        agent_cmd.arg("--staging-root").arg(&staging);
        agent_cmd.args(extra);
        let controller = ChildGuard::spawn(
            "genswap-controller",
            controller_cmd,
            dir.path().join("controller.log"),
        );
        let agent = ChildGuard::spawn("node-agent", agent_cmd, dir.path().join("agent.log"));
        Stack {
            agent,
            controller,
            namespace,
            cgroups,
            hostname,
            node_name,
            staging,
            run_dir,
            dir,
        }
    }

    /// Another agent in this stack's namespace, acting as a new Node
    /// labelled `labels`, with a cgroup subtree and directories of its own.
    pub async fn second_agent(
        &self,
        cluster: &Cluster,
        tag: &str,
        labels: &[(&str, &str)],
    ) -> SecondAgent {
        self.second_agent_with(cluster, tag, labels, Vec::new())
            .await
    }

    /// [`Stack::second_agent`], given `extra` flags too.
    pub async fn second_agent_with(
        &self,
        cluster: &Cluster,
        tag: &str,
        labels: &[(&str, &str)],
        extra: Vec<OsString>,
    ) -> SecondAgent {
        let node = cluster.node_with(tag, labels).await;
        let node_name = node.metadata.name.clone().expect("a node name");
        let dir = host_dir();
        let cgroups = CgroupGuard::create(
            &host_requirements(),
            &format!("genswap-e2e-{tag}-{}", unique()),
        );
        let mut command = agent_command(cluster, &node, &self.namespace.name, &cgroups, dir.path());
        // The builds' paths are the same on every node.
        command.arg("--staging-root").arg(&self.staging);
        command.args(extra);
        let agent = ChildGuard::spawn("node-agent", command, dir.path().join("agent.log"));
        SecondAgent {
            agent,
            run_dir: dir.path().join("run"),
            node_name,
            cgroups,
            dir,
        }
    }

    /// An InstanceGeneration `name` of `build` for this stack's node and
    /// namespace, run as nobody, with short health, settle and stop
    /// windows.
    pub fn instance_generation(
        &self,
        name: &str,
        build: &testapp::Build,
        settle_seconds: i32,
    ) -> serde_json::Value {
        let id = build
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "InstanceGeneration",
            "metadata": {"name": name, "namespace": self.namespace.name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": self.hostname},
                "build": {"id": id, "artifact": {"path": build.path.to_string_lossy()}, "sha256": build.sha256},
                "process": {"user": INSTANCE_ID, "group": INSTANCE_ID},
                "health": {"path": "/", "timeoutSeconds": 5},
                "settle": {"seconds": settle_seconds},
                "stop": {"timeoutSeconds": 5},
            },
        })
    }

    /// `<run dir>/<namespace>.<ig>/current.sock`.
    pub fn current_sock(&self, ig: &str) -> PathBuf {
        self.instance_run_dir(ig).join("current.sock")
    }

    /// `<run dir>/<namespace>.<ig>`.
    pub fn instance_run_dir(&self, ig: &str) -> PathBuf {
        self.run_dir.join(format!("{}.{ig}", self.namespace.name))
    }

    /// `<cgroup root>/<namespace>.<ig>`.
    pub fn instance_cgroup(&self, ig: &str) -> PathBuf {
        self.cgroups
            .root
            .join(format!("{}.{ig}", self.namespace.name))
    }

    /// Panics, with its log, when the controller or the agent exited.
    pub fn assert_running(&mut self) {
        self.controller.assert_running();
        self.agent.assert_running();
    }

    /// The processes' last log lines, for a failure message.
    pub fn diagnosis(&self) -> String {
        format!(
            "\n--- controller log (tail) ---\n{}\n--- agent log (tail) ---\n{}",
            self.controller.tail(40),
            self.agent.tail(40)
        )
    }
}

/// A further agent of a [`Stack`] ([`Stack::second_agent`]). Fields drop
/// in order: the agent, then its cgroups and dirs.
pub struct SecondAgent {
    pub agent: ChildGuard,
    pub node_name: String,
    pub run_dir: PathBuf,
    pub cgroups: CgroupGuard,
    pub dir: tempfile::TempDir,
}

/// `node-agent run` as `node` for `namespace`, its instances in `cgroups`,
/// its run, state and log directories under `dir` (the staging root is the
/// caller's to add).
fn agent_command(
    cluster: &Cluster,
    node: &Node,
    namespace: &str,
    cgroups: &CgroupGuard,
    dir: &Path,
) -> Command {
    let node_name = node.metadata.name.as_deref().expect("a node name");
    let mut command = Command::new(&build_binaries().agent);
    command
        .args([
            "run",
            "--node-name",
            node_name,
            "--namespace",
            namespace,
            // As the chart runs it: the controller keeps the inboxes where
            // its Lease is.
            "--inbox-namespace",
            cluster.lease_namespace(namespace),
            "--no-host-namespaces",
            "--metrics-addr",
            "127.0.0.1:0",
            "--shutdown-timeout-seconds",
            "20",
        ])
        .args(cluster.agent_args(node))
        .arg("--cgroup-root")
        .arg(&cgroups.root)
        .arg("--run-dir")
        .arg(dir.join("run"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--log-dir")
        .arg(dir.join("logs"));
    command
}

/// A fresh cgroup subtree for the agent's instances; on drop every process
/// in it is killed (cgroup.kill), proven gone (populated 0) and the
/// directories removed, deepest first.
pub struct CgroupGuard {
    /// The subtree's root.
    pub root: PathBuf,
}

impl CgroupGuard {
    /// Creates `<mount>/<name>`.
    pub fn create(mount: &Path, name: &str) -> Self {
        let root = mount.join(name);
        fs::create_dir(&root)
            .unwrap_or_else(|e| panic!("create the cgroup {}: {e}", root.display()));
        CgroupGuard { root }
    }
}

fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&entry.path());
            }
        }
    }
    let _ = fs::write(dir.join("cgroup.kill"), "1");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let events = fs::read_to_string(dir.join("cgroup.events")).unwrap_or_default();
        if !events.lines().any(|line| line == "populated 1") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = fs::remove_dir(dir);
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.root);
    }
}

/// A namespace of the suite's own; deleted on drop (with everything in it).
pub struct NamespaceGuard {
    /// Its name.
    pub name: String,
    kubeconfig: Option<PathBuf>,
}

impl Drop for NamespaceGuard {
    fn drop(&mut self) {
        let mut command = Command::new("kubectl");
        if let Some(path) = &self.kubeconfig {
            command.env("KUBECONFIG", path);
        }
        let _: std::io::Result<Output> = command
            .args([
                "delete",
                "namespace",
                &self.name,
                "--wait=false",
                "--ignore-not-found",
            ])
            .output();
    }
}

/// A temp dir instances (running as another uid) can traverse.
pub fn host_dir() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("genswap-e2e-")
        .tempdir()
        .expect("create a temp dir");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o711))
        .expect("open the temp dir to instances");
    dir
}

/// `GET /` through a unix socket: the response body, or why not.
pub fn get_over(socket: &Path) -> Result<String, String> {
    let mut stream =
        UnixStream::connect(socket).map_err(|e| format!("connect {}: {e}", socket.display()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: e2e\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| format!("read: {e}"))?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .ok_or_else(|| format!("not an HTTP response: {response:?}"))
}

pub fn path_str(path: &Path) -> String {
    path.to_str()
        .unwrap_or_else(|| panic!("{} is not UTF-8", path.display()))
        .to_string()
}

/// Applies the committed CRDs server-side and waits until both are
/// established.
pub fn apply_crds(cluster: &Cluster) {
    let crds = workspace().join("crds");
    cluster.kubectl(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        &path_str(&crds),
    ]);
    cluster.kubectl(&[
        "wait",
        "--for=condition=Established",
        "crd/instancegenerations.genswap.dev",
        "crd/swapattempts.genswap.dev",
        "--timeout=60s",
    ]);
}

/// An image of the test app's server at `/bin/testapp` (a distinct build
/// of `server`, the host's or a static one), built by umoci in `dir` and
/// pushed as `apps/testapp:<name>`; its manifest's digest (hex).
pub fn push_testapp_image(
    registry: &test_cluster::registry::Registry,
    dir: &Path,
    name: &str,
    server: &Path,
) -> String {
    let image = test_cluster::registry::Umoci::new(&dir.join(format!("image-{name}")), name);
    let rootfs = image.rootfs();
    fs::create_dir_all(rootfs.join("bin")).expect("bin");
    let build =
        testapp::make_build_from(server, dir, &format!("server-{name}")).expect("the server");
    fs::copy(&build.path, rootfs.join("bin/testapp")).expect("copy the server");
    image.layer();
    image.config(&["--config.entrypoint", "/bin/testapp"]);
    registry.push(&image.layout, image.tag(), "apps/testapp", name, &[])
}
