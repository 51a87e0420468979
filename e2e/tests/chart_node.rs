//! The chart on a real node: the image built here (charts/genswap/image/build,
//! buildah from scratch), a kubelet with containerd and runc
//! (`../shared/kube/node-up`), `helm install`, and the whole story in pods:
//! the controller Deployment and the agent DaemonSet Ready by their own
//! probes, an InstanceGeneration applied with kubectl served by an instance
//! the agent's pod started, `kubectl wait` and `kubectl genswap get`, an
//! image build pulled by the pod from a registry on loopback with the
//! credentials and CA the chart mounts (a Secret made by `kubectl create
//! secret docker-registry`, a ConfigMap), verified against the cosign
//! signature beside it with the key of the trust keys ConfigMap the chart
//! mounts (`build.signedBy`), and a second image overlapping it
//! with its tree as its root (`process.root: build`, mounted by the pod's
//! agent under the runtime's seccomp profile) while a client sends
//! requests without pause, then
//! the agent replaced three ways (a DaemonSet rolling update by `helm
//! upgrade`, `kubectl delete pod`, its container killed with `ctr`) while a
//! client sends requests without pause, and `helm uninstall` after the
//! documented steps (docs/INSTALL.md, "Uninstalling").
//!
//! What this machine cannot show, so this test does not: PID 1's
//! namespaces are hidden here (`/proc/1/ns` is unreadable), so the agent
//! runs with `agent.joinHostNamespaces: false` and its instances see the
//! container's file system; the instance is therefore a statically linked
//! build of the test app (the join itself is covered in the VM,
//! node-agent/tests/vm_pod_namespaces.rs). This host is hybrid (cgroup v1
//! controllers, an empty v2 tree), so the agent's move of its children
//! out of the pod's v1 cgroups (node-agent/src/cgroup/hybrid.rs) is what
//! keeps the instance alive through the pod's restarts here.
//!
//! It needs root, `../shared/kube` (with `node-up`), buildah and helm; it
//! says in one line that it skipped when one is missing, and fails instead
//! under `GENSWAP_NODE=required` (CI).

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{CgroupGuard, build_binaries, get_over, host_requirements, path_str, unique};
use test_cluster::ControlPlane;
use test_cluster::registry::{Access, PASSWORD, Registry, USER};
use test_cluster::signing::{self, KeyPair};

/// The node `node-up` adds.
const NODE: &str = "localhost";
const RELEASE: &str = "genswap";
const RELEASE_NAMESPACE: &str = "genswap-system";
const NAMESPACE: &str = "e2e-node";
/// The instance followed through every restart of the agent.
const SERVED: &str = "web";
/// The instance deleted before `helm uninstall`, as the docs say.
const DELETED: &str = "gone";
/// The instance whose builds are images pulled from a registry.
const IMAGE: &str = "img";
/// The `kubernetes.io/dockerconfigjson` Secret and the CA ConfigMap the
/// chart mounts into the agent.
const PULL_SECRET: &str = "registry-pull";
const REGISTRY_CA: &str = "registry-ca";
/// The ConfigMap of the keys image builds are signed by.
const TRUST_KEYS: &str = "trust-keys";
/// Generous: pods start, probes pass and agents recover on a shared
/// 2-core machine.
const DEADLINE: Duration = Duration::from_secs(180);

/// Why the node cannot be run here, or `None`.
fn why_not_here() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    let node_up = kube_scripts().join("node-up");
    if !node_up.is_file() {
        return Some(format!("{} not found", node_up.display()));
    }
    if !ControlPlane::can_start() {
        return Some("no control plane can start here".into());
    }
    for tool in ["buildah", "readelf"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Some(format!(
                "{tool} is not on PATH (.ci/install-node installs it)"
            ));
        }
    }
    None
}

fn kube_scripts() -> PathBuf {
    std::env::var_os("GENSWAP_KUBE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| support::workspace().join("../shared/kube"))
}

/// Runs `command`, panicking with its output when it fails.
fn run(what: &str, command: &mut Command) -> String {
    let output: Output = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}): {}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The image, built as docs/INSTALL.md says, into the target directory.
fn build_image(target: &Path) -> (PathBuf, String) {
    let archive = target.join("genswap-image").join("genswap.oci.tar");
    let began = Instant::now();
    let output = Command::new(support::workspace().join("charts/genswap/image/build"))
        .arg(&archive)
        .env("CARGO_TARGET_DIR", target)
        .output()
        .expect("run charts/genswap/image/build");
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "building the image failed: {said}");
    let image = String::from_utf8_lossy(&output.stdout).trim().to_string();
    // Its digest and size, for the record.
    for line in said
        .lines()
        .filter(|l| l.starts_with("build-image: localhost/"))
    {
        println!("{line} (built in {:.0} s)", began.elapsed().as_secs_f64());
    }
    (archive, image)
}

/// The test app linked statically, as the image's binaries are: the
/// instance runs in the container's file system, which has no libc.
fn static_testapp(target: &Path) -> PathBuf {
    let host = run("rustc -vV", Command::new("rustc").arg("-vV"));
    let triple = host
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc names its host")
        .to_string();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(
        "cargo build of the static test app",
        Command::new(cargo)
            .args(["build", "--release", "--locked", "-p", "testapp"])
            .args(["--target", &triple])
            .arg("--manifest-path")
            .arg(support::workspace().join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", target)
            .env("RUSTFLAGS", "-C target-feature=+crt-static"),
    );
    target
        .join(triple)
        .join("release")
        .join(testapp::BINARY_NAME)
}

/// A free port on loopback (the kernel's pick, released at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The cgroup v1 homes the agent's children join (node-agent's
/// cgroup::hybrid): removed on drop once empty. The instances in them are
/// killed by their v2 cgroups first ([`CgroupGuard`]).
struct V1Homes;

impl Drop for V1Homes {
    fn drop(&mut self) {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for line in mountinfo.lines() {
            let Some((mount, fs_fields)) = line.split_once(" - ") else {
                continue;
            };
            if fs_fields.split_whitespace().next() != Some("cgroup") {
                continue;
            }
            if let Some(point) = mount.split_whitespace().nth(4) {
                let home = Path::new(point).join(node_agent::cgroup::hybrid::V1_HOME);
                let _ = fs::remove_dir(home);
            }
        }
    }
}

/// GETs through `current.sock` without pause until stopped; counts answers
/// and failures.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    thread: Option<JoinHandle<Vec<String>>>,
}

impl Load {
    fn start(socket: PathBuf) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let thread = {
            let (stop, ok) = (stop.clone(), ok.clone());
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match get_over(&socket) {
                        Ok(body) if body.contains("build=") => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(body) => failures.push(format!("unexpected answer {body:?}")),
                        Err(why) => failures.push(why),
                    }
                }
                failures
            })
        };
        Load {
            stop,
            ok,
            thread: Some(thread),
        }
    }

    fn answered(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    /// Stops it: (answers, failures).
    fn finish(mut self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let failures = self
            .thread
            .take()
            .map(|t| t.join().expect("the load thread"))
            .unwrap_or_default();
        (self.answered(), failures)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// How the agent's pod is replaced.
#[derive(Clone, Copy, Debug)]
enum Replacement {
    /// A DaemonSet rolling update: `helm upgrade` of a pod annotation.
    RollingUpdate,
    /// `kubectl delete pod`.
    DeletePod,
    /// Its container SIGKILLed with `ctr`: the kubelet restarts it.
    KillContainer,
}

impl Replacement {
    const ALL: [Replacement; 3] = [
        Replacement::RollingUpdate,
        Replacement::DeletePod,
        Replacement::KillContainer,
    ];
}

/// One run of the story, its parts in drop order: the control plane and
/// node go first (`down --wipe`: no kubelet restarts anything after), then
/// the instances by their cgroups, then the v1 homes and the host dirs.
struct Story {
    plane: ControlPlane,
    _instances: CgroupGuard,
    _v1_homes: V1Homes,
    host: tempfile::TempDir,
    run_dir: tempfile::TempDir,
    kubectl_path: String,
}

impl Story {
    fn kubectl(&self, args: &[&str]) -> String {
        run(
            &format!("kubectl {}", args.join(" ")),
            Command::new("kubectl")
                .args(args)
                .env("KUBECONFIG", self.plane.kubeconfig())
                .env("PATH", &self.kubectl_path),
        )
    }

    fn helm(&self, args: &[&str]) -> String {
        run(
            &format!("helm {}", args.join(" ")),
            Command::new(test_cluster::helm::helm())
                .args(args)
                .args(["--namespace", RELEASE_NAMESPACE])
                .arg("--kubeconfig")
                .arg(self.plane.kubeconfig()),
        )
    }

    /// Replaces agent pod `pod` as `how` says; `values` are the release's
    /// values files.
    fn replace_agent(&self, how: Replacement, pod: &str, values: &[&str]) {
        match how {
            Replacement::RollingUpdate => {
                let chart = path_str(&support::workspace().join("charts/genswap"));
                let mut args = vec!["upgrade", RELEASE, &chart];
                for file in values {
                    args.extend(["--values", file]);
                }
                args.extend(["--set-string", "agent.podAnnotations.genswap-e2e/rollout=2"]);
                self.helm(&args);
            }
            Replacement::DeletePod => {
                self.kubectl(&[
                    "delete",
                    "pod",
                    "-n",
                    RELEASE_NAMESPACE,
                    pod,
                    "--wait=false",
                ]);
            }
            Replacement::KillContainer => {
                let id = self.container_id(pod);
                self.ctr(&["task", "kill", "-s", "SIGKILL", &id]);
            }
        }
    }

    fn staging(&self) -> PathBuf {
        self.host.path().join("staging")
    }

    fn current_sock(&self, ig: &str) -> PathBuf {
        self.run_dir
            .path()
            .join(format!("{NAMESPACE}.{ig}"))
            .join("current.sock")
    }

    /// The agent pod's name and container restart count, once one is Ready.
    fn ready_agent(&self, not: Option<(&str, u64)>) -> (String, u64) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let pods: Value = serde_json::from_str(&self.kubectl(&[
                "get",
                "pods",
                "-n",
                RELEASE_NAMESPACE,
                "-l",
                "app.kubernetes.io/component=node-agent",
                "-o",
                "json",
            ]))
            .expect("pods as JSON");
            let ready: Vec<(String, u64)> = pods["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|pod| pod["metadata"]["deletionTimestamp"].is_null())
                .filter(|pod| {
                    pod["status"]["conditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
                .map(|pod| {
                    (
                        pod["metadata"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string(),
                        pod["status"]["containerStatuses"][0]["restartCount"]
                            .as_u64()
                            .unwrap_or_default(),
                    )
                })
                .collect();
            if let [(name, restarts)] = ready.as_slice()
                && not.is_none_or(|(old, old_restarts)| old != name || *restarts > old_restarts)
            {
                return (name.clone(), *restarts);
            }
            assert!(
                Instant::now() < deadline,
                "no new Ready agent pod within {DEADLINE:?} (not {not:?}); pods: {}",
                self.kubectl(&["get", "pods", "-A", "-o", "wide"])
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// How many instances the current container of agent pod `pod` found
    /// serving when it started ("crash recovery done").
    fn adopted_by(&self, pod: &str) -> u64 {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let log = self.kubectl(&["logs", "-n", RELEASE_NAMESPACE, pod]);
            let recovered = log
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|l| l["fields"]["message"] == "crash recovery done");
            if let Some(line) = recovered {
                return line["fields"]["serving"].as_u64().unwrap_or_default();
            }
            assert!(
                Instant::now() < deadline,
                "agent {pod} did not recover: {log}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// An InstanceGeneration of `build` for the node, run as nobody.
    fn apply_instance(&self, name: &str, build: &testapp::Build) {
        let id = build
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        self.apply_build(
            name,
            serde_json::json!({"id": id, "artifact": {"path": path_str(&build.path)}, "sha256": build.sha256}),
        );
    }

    /// An InstanceGeneration of the image `apps/testapp:<tag>@sha256:<digest>`
    /// in `registry`, build id `image-<tag>`, signed by the key `release`;
    /// run with the image's tree as its root when `in_its_tree`
    /// (`process.root: build`).
    fn apply_image(
        &self,
        name: &str,
        registry: &Registry,
        (tag, digest): (&str, &str),
        in_its_tree: bool,
    ) {
        let mut process =
            serde_json::json!({"user": support::INSTANCE_ID, "group": support::INSTANCE_ID});
        if in_its_tree {
            process["root"] = "build".into();
        }
        self.apply_spec(
            name,
            serde_json::json!({
                "id": format!("image-{tag}"),
                "artifact": {"image": format!("{}/apps/testapp:{tag}@sha256:{digest}", registry.addr)},
                "sha256": digest,
                "signedBy": "release",
            }),
            process,
        );
    }

    /// Waits until each of `igs` is Ready; if one is not in time, fails
    /// with what its attempts say.
    fn wait_ready(&self, igs: &[&str]) {
        let mut args = vec![
            "wait".to_string(),
            "-n".into(),
            NAMESPACE.into(),
            "--for=condition=Ready".into(),
            "--timeout=180s".into(),
        ];
        args.extend(igs.iter().map(|ig| format!("instancegeneration/{ig}")));
        let output = Command::new("kubectl")
            .args(&args)
            .env("KUBECONFIG", self.plane.kubeconfig())
            .env("PATH", &self.kubectl_path)
            .output()
            .expect("run kubectl wait");
        if !output.status.success() {
            let attempts = self.kubectl(&[
                "get",
                "swapattempts",
                "-n",
                NAMESPACE,
                "-o",
                "jsonpath={range .items[*]}{.metadata.name}: {.status.outcome}: {.status.reason}{\"\\n\"}{end}",
            ]);
            let agent_log = self.kubectl(&[
                "logs",
                "-n",
                RELEASE_NAMESPACE,
                "-l",
                "app.kubernetes.io/component=node-agent",
                "--tail=40",
            ]);
            panic!(
                "{igs:?} not Ready in 180 s: {}\nattempts:\n{attempts}\nthe agent's log:\n{agent_log}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }

    /// Waits until `ig` is Ready and serves `build` on the node.
    fn wait_serving(&self, ig: &str, build: &str) {
        let object = format!("instancegeneration/{ig}");
        self.kubectl(&[
            "wait",
            "-n",
            NAMESPACE,
            &format!("--for=jsonpath={{.status.nodes[0].build}}={build}"),
            &object,
            "--timeout=180s",
        ]);
        self.kubectl(&[
            "wait",
            "-n",
            NAMESPACE,
            "--for=condition=Ready",
            &object,
            "--timeout=180s",
        ]);
    }

    fn apply_build(&self, name: &str, build: Value) {
        self.apply_spec(
            name,
            build,
            serde_json::json!({"user": support::INSTANCE_ID, "group": support::INSTANCE_ID}),
        );
    }

    fn apply_spec(&self, name: &str, build: Value, process: Value) {
        let manifest = serde_json::json!({
            "apiVersion": "genswap.dev/v1alpha1",
            "kind": "InstanceGeneration",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "build": build,
                "process": process,
                "health": {"path": "/", "timeoutSeconds": 30},
                "stop": {"timeoutSeconds": 5},
            },
        });
        let file = self.host.path().join(format!("{name}.json"));
        fs::write(&file, manifest.to_string()).expect("write the manifest");
        self.kubectl(&["apply", "-f", &path_str(&file)]);
    }

    /// Agent pod `pod`'s container, as containerd names it.
    fn container_id(&self, pod: &str) -> String {
        let id = self.kubectl(&[
            "get",
            "pod",
            "-n",
            RELEASE_NAMESPACE,
            pod,
            "-o",
            "jsonpath={.status.containerStatuses[0].containerID}",
        ]);
        id.trim().trim_start_matches("containerd://").to_string()
    }

    /// `ctr` against the node's containerd, in the kubelet's namespace.
    fn ctr(&self, args: &[&str]) -> String {
        let socket = self.plane.dir().join("node/containerd/containerd.sock");
        run(
            &format!("ctr {}", args.join(" ")),
            Command::new("ctr")
                .arg("-a")
                .arg(&socket)
                .args(["-n", "k8s.io"])
                .args(args),
        )
    }

    /// The pid of agent pod `pod`'s container, as containerd knows it.
    fn agent_pid(&self, pod: &str) -> u32 {
        let id = self.container_id(pod);
        let tasks = self.ctr(&["task", "ls"]);
        tasks
            .lines()
            .find(|l| l.starts_with(&id))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no task {id} in {tasks}"))
    }

    fn serving_pid(&self, ig: &str) -> Option<u32> {
        let body = get_over(&self.current_sock(ig)).ok()?;
        body.split_whitespace()
            .find_map(|w| w.strip_prefix("pid="))
            .and_then(|p| p.parse().ok())
    }
}

#[test]
fn the_chart_runs_the_whole_story_on_a_real_node() {
    if let Some(why) = why_not_here() {
        assert!(
            std::env::var("GENSWAP_NODE").as_deref() != Ok("required"),
            "GENSWAP_NODE=required, but the chart cannot run on a node here: {why}"
        );
        println!("chart on a real node: skipped: {why}");
        return;
    }
    let cgroup2 = host_requirements();
    let binaries = build_binaries();
    let target = binaries
        .bin_dir
        .parent()
        .expect("<target>/<profile>")
        .to_path_buf();
    let (archive, image) = build_image(&target);
    let static_app = static_testapp(&target);

    let tag = unique();
    let instances = CgroupGuard::create(&cgroup2, &format!("genswap-e2e-node-{tag}"));
    let v1_homes = V1Homes;
    let host = support::host_dir();
    // A run dir short enough for its sockets (at most 28 bytes).
    let run_dir = node_agent::sandbox::short_dir("gs-").expect("a run dir");
    let plane = ControlPlane::own().expect("a control plane (checked above)");
    let kubectl_path = format!(
        "{}:{}",
        binaries.bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let story = Story {
        plane,
        _instances: instances,
        _v1_homes: v1_homes,
        host,
        run_dir,
        kubectl_path,
    };
    for dir in ["staging", "state", "logs"] {
        fs::create_dir(story.host.path().join(dir)).expect("a host dir");
    }

    let began = Instant::now();
    let node = run(
        "node-up",
        Command::new(kube_scripts().join("node-up"))
            .arg(story.plane.dir())
            .arg(&archive),
    );
    assert_eq!(node.trim(), NODE);
    println!(
        "chart on a real node: node Ready in {:.1} s",
        began.elapsed().as_secs_f64()
    );

    // A registry on loopback (the agent's pod is on the node's network),
    // TLS from the test's CA and basic auth.
    let registry = Registry::start(Access::TlsWithAuth);
    // The release key image builds are signed by, as cosign's would be.
    let release_key = KeyPair::generate(&story.host.path().join("keys"), "release");

    // The chart's values for such a node, and what is this run's own: the
    // image's tag, free ports, the host paths.
    let node_values =
        path_str(&support::workspace().join("charts/genswap/ci/local-node-values.yaml"));
    let (repository, image_tag) = image.rsplit_once(':').expect("repository:tag");
    let api_port = story
        .plane
        .server()
        .rsplit_once(':')
        .map(|(_, port)| port.to_string())
        .expect("the API server's port");
    let mut values = serde_json::json!({
        "image": {"repository": repository, "tag": image_tag},
        "apiServer": {"port": api_port.parse::<u16>().expect("a port")},
        "controller": {"metrics": {"port": free_port()}},
        "agent": {
            "metrics": {"port": free_port()},
            "cgroupRoot": path_str(&story._instances.root),
            "hostPaths": {
                "runDir": path_str(story.run_dir.path()),
                "stateDir": path_str(&story.host.path().join("state")),
                "stagingRoot": path_str(&story.staging()),
                "logDir": path_str(&story.host.path().join("logs")),
            },
            "shutdownTimeoutSeconds": 20,
            "terminationGracePeriodSeconds": 35,
        },
    });
    if registry.is_some() {
        values["agent"]["registryConfig"] = serde_json::json!({"secretName": PULL_SECRET});
        values["agent"]["registryCA"] = serde_json::json!({"configMapName": REGISTRY_CA});
        values["agent"]["trustKeys"] = serde_json::json!({"configMapName": TRUST_KEYS});
    }
    let values_file = story.host.path().join("values.json");
    fs::write(&values_file, values.to_string()).expect("write the values");
    let values_file = path_str(&values_file);

    story.kubectl(&["create", "namespace", RELEASE_NAMESPACE]);
    story.kubectl(&["create", "namespace", NAMESPACE]);
    if let Some(registry) = &registry {
        // As a cluster admin makes them, with kubectl's own formats.
        story.kubectl(&[
            "create",
            "secret",
            "docker-registry",
            PULL_SECRET,
            "-n",
            RELEASE_NAMESPACE,
            &format!("--docker-server={}", registry.addr),
            &format!("--docker-username={USER}"),
            &format!("--docker-password={PASSWORD}"),
        ]);
        story.kubectl(&[
            "create",
            "configmap",
            REGISTRY_CA,
            "-n",
            RELEASE_NAMESPACE,
            &format!("--from-file=ca.crt={}", path_str(&registry.ca)),
        ]);
        story.kubectl(&[
            "create",
            "configmap",
            TRUST_KEYS,
            "-n",
            RELEASE_NAMESPACE,
            &format!("--from-file=release.pub={}", path_str(&release_key.public)),
        ]);
    }
    let began = Instant::now();
    story.helm(&[
        "install",
        RELEASE,
        &path_str(&support::workspace().join("charts/genswap")),
        "--values",
        &node_values,
        "--values",
        &values_file,
        "--wait",
        "--timeout",
        "300s",
    ]);
    println!(
        "chart on a real node: helm install to the controller and the agent Ready in {:.1} s",
        began.elapsed().as_secs_f64()
    );
    let (agent, _) = story.ready_agent(None);

    // Installs, applied with kubectl, served by instances the pod started.
    let v1 = testapp::make_build_from(&static_app, &story.staging(), "v1").expect("build v1");
    story.apply_instance(SERVED, &v1);
    story.apply_instance(DELETED, &v1);
    let began = Instant::now();
    story.wait_ready(&[SERVED, DELETED]);
    println!(
        "chart on a real node: both InstanceGenerations Ready {:.1} s after kubectl apply",
        began.elapsed().as_secs_f64()
    );
    let shown = story.kubectl(&["genswap", "get", SERVED, "-n", NAMESPACE]);
    assert!(shown.contains(&format!("node {NODE}")), "{shown}");
    assert!(shown.contains("serving v1"), "{shown}");
    let pid = story.serving_pid(SERVED).expect("the instance answers");

    // The instance's open-files limit is systemd's, not the agent's pod's
    // (at most the agent's own hard limit where it cannot raise it).
    let agent_pid = story.agent_pid(&agent);
    let (agent_soft, agent_hard) = nofile_of(agent_pid);
    let (soft, hard) = nofile_of(pid);
    println!(
        "chart on a real node: nofile of the agent's pod {agent_soft}/{agent_hard}, of its instance {soft}/{hard}"
    );
    assert_eq!(soft, "1024");
    let systemd_hard: u64 = 524_288;
    let expected_hard = agent_hard
        .parse::<u64>()
        .map_or(systemd_hard, |agent| agent.min(systemd_hard));
    assert!(
        hard == systemd_hard.to_string() || hard == expected_hard.to_string(),
        "the instance's hard nofile {hard}, the agent's {agent_hard}"
    );

    // Image builds, pulled by the agent's pod with the mounted Secret and
    // CA: one installs, a second overlaps it under load.
    let mut instances = 2;
    let mut image_pid = None;
    if let Some(registry) = &registry {
        let images = story.host.path().join("images");
        fs::create_dir(&images).expect("an images dir");
        let one = support::push_testapp_image(registry, &images, "one", &static_app);
        let two = support::push_testapp_image(registry, &images, "two", &static_app);
        for digest in [&one, &two] {
            signing::sign_image(
                registry,
                &images,
                "apps/testapp",
                digest,
                digest,
                &release_key,
            );
        }
        let began = Instant::now();
        story.apply_image(IMAGE, registry, ("one", &one), false);
        story.wait_serving(IMAGE, "image-one");
        println!(
            "chart on a real node: image one pulled and serving {:.1} s after kubectl apply",
            began.elapsed().as_secs_f64()
        );
        let load = Load::start(story.current_sock(IMAGE));
        let began = Instant::now();
        // The second with its tree as its root (the pod's agent mounts it,
        // under the container runtime's seccomp profile).
        story.apply_image(IMAGE, registry, ("two", &two), true);
        story.wait_serving(IMAGE, "image-two");
        let took = began.elapsed().as_secs_f64();
        let (answered, failures) = load.finish();
        println!(
            "chart on a real node: image two overlapped image one in {took:.1} s: {answered} answered, {} failed",
            failures.len()
        );
        assert!(
            failures.is_empty(),
            "requests failed while image two replaced image one: {:?}",
            &failures[..failures.len().min(5)]
        );
        assert!(answered > 0, "no request was answered");
        let shown = story.kubectl(&["genswap", "get", IMAGE, "-n", NAMESPACE]);
        assert!(shown.contains("serving image-two"), "{shown}");
        instances += 1;
        image_pid = story.serving_pid(IMAGE);
        let exe = image_pid.and_then(|pid| fs::read_link(format!("/proc/{pid}/exe")).ok());
        assert_eq!(
            exe.as_deref(),
            Some(Path::new("/bin/testapp")),
            "image two runs with its tree as its root"
        );
    }

    // The agent replaced three ways while a client sends without pause.
    let load = Load::start(story.current_sock(SERVED));
    let mut agent = (agent, 0);
    for how in Replacement::ALL {
        let before = load.answered();
        story.replace_agent(how, &agent.0, &[&node_values, &values_file]);
        agent = story.ready_agent(Some((&agent.0, agent.1)));
        assert_eq!(
            story.adopted_by(&agent.0),
            instances,
            "the new agent ({how:?}) adopts every instance"
        );
        assert_eq!(
            story.serving_pid(IMAGE),
            image_pid,
            "the image build serves on after {how:?}"
        );
        assert_eq!(
            story.serving_pid(SERVED),
            Some(pid),
            "the same process serves after {how:?}"
        );
        println!(
            "chart on a real node: {how:?}: agent {} restarts {}, {} answers meanwhile",
            agent.0,
            agent.1,
            load.answered() - before
        );
    }
    let (answered, failures) = load.finish();
    println!(
        "chart on a real node: {} of {} requests failed across the three replacements of the agent",
        failures.len(),
        answered + failures.len() as u64
    );
    assert!(
        failures.is_empty(),
        "requests failed while the agent was replaced: {:?}",
        &failures[..failures.len().min(5)]
    );
    assert!(answered > 0, "no request was answered");

    // Uninstalling as docs/INSTALL.md says: an InstanceGeneration deleted
    // while the agent runs is stopped by it; one left in place keeps
    // serving after `helm uninstall`, a host process.
    let deleted_pid = story
        .serving_pid(DELETED)
        .expect("the second instance answers");
    story.kubectl(&[
        "delete",
        "instancegeneration",
        "-n",
        NAMESPACE,
        DELETED,
        "--wait",
    ]);
    story.kubectl(&[
        "wait",
        "--for=delete",
        "swapattempts",
        "-n",
        NAMESPACE,
        "-l",
        &format!("genswap.dev/instance={DELETED}"),
        "--timeout=120s",
    ]);
    let deadline = Instant::now() + DEADLINE;
    while Path::new(&format!("/proc/{deleted_pid}")).exists() {
        assert!(
            Instant::now() < deadline,
            "the deleted InstanceGeneration's instance still runs"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    story.helm(&["uninstall", RELEASE, "--wait", "--timeout", "120s"]);
    assert_eq!(
        story.serving_pid(SERVED),
        Some(pid),
        "the instance left in place serves after helm uninstall"
    );
    drop(story);
}

/// `Max open files` of `pid`: (soft, hard) as `/proc/PID/limits` says.
fn nofile_of(pid: u32) -> (String, String) {
    let text = fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .unwrap_or_else(|| panic!("no open files limit in {text}"));
    let mut words = line.split_whitespace();
    (
        words.next().unwrap_or_default().to_owned(),
        words.next().unwrap_or_default().to_owned(),
    )
}
