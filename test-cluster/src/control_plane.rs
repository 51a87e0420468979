//! Starting, stopping and tearing down a real control plane
//! (`../shared/kube/up DIR`), and the credentials a test runs components
//! under.
//!
//! Teardown must happen whatever the test process does, panics and aborts
//! included, and `up` starts its servers in sessions of their own, so they
//! outlive the test. Each control plane therefore has a watchdog: a shell
//! in its own process group that blocks reading a pipe only the test
//! process holds (close-on-exec, so no child inherits it). When the pipe
//! closes (an owned control plane dropped, or the test process gone for
//! whatever reason) the watchdog runs `down DIR --wipe`.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Printed, with the reason, by a test that finds no control plane to start.
pub const SKIP_LINE: &str = "cluster tests: skipped: no real control plane";

/// The tools `up` needs besides its own binaries.
const TOOLS: [&str; 5] = ["kubectl", "xz", "openssl", "curl", "python3"];

/// How long the API server may take to stop or to become ready again.
const RESTART_DEADLINE: Duration = Duration::from_secs(90);

/// A running control plane: an admin kubeconfig and the directory `up`
/// keeps everything in (binaries, PKI, etcd data, logs, pid files).
pub struct ControlPlane {
    dir: PathBuf,
    kubeconfig: PathBuf,
    scripts: PathBuf,
    /// The watchdog and the write end it reads; dropping it tears down.
    watchdog: Option<(Child, ChildStdin)>,
}

impl ControlPlane {
    /// The control plane every test of this binary shares, started by the
    /// first to ask. `None`, having printed [`SKIP_LINE`], where there is
    /// none to start; panics where it cannot start, or under
    /// `GENSWAP_KUBE=required` where there is none.
    ///
    /// Tests that share it must not stop its API server, and should keep
    /// to namespaces of their own.
    pub fn shared() -> Option<&'static ControlPlane> {
        static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
        if !Self::startable() {
            return None;
        }
        match SHARED.get_or_init(Self::start) {
            Ok(plane) => Some(plane),
            Err(error) => panic!("the shared control plane did not start: {error}"),
        }
    }

    /// A control plane of the caller's own, torn down when dropped. As
    /// [`ControlPlane::shared`] where there is none.
    pub fn own() -> Option<ControlPlane> {
        if !Self::startable() {
            return None;
        }
        Some(Self::start().unwrap_or_else(|e| panic!("the control plane did not start: {e}")))
    }

    /// Whether a control plane can be started here (`up` and the tools it
    /// needs are there), without starting one.
    pub fn can_start() -> bool {
        why_absent().is_none()
    }

    /// [`ControlPlane::can_start`]; where not, prints [`SKIP_LINE`] and
    /// why, or panics under `GENSWAP_KUBE=required`.
    fn startable() -> bool {
        let Some(why) = why_absent() else {
            return true;
        };
        if std::env::var("GENSWAP_KUBE").as_deref() == Ok("required") {
            panic!("GENSWAP_KUBE=required, but there is no control plane to start: {why}");
        }
        println!("{SKIP_LINE} ({why})");
        false
    }

    fn start() -> Result<ControlPlane, String> {
        let scripts = scripts_dir();
        let dir = tempfile::Builder::new()
            .prefix("genswap-apiserver-")
            .tempdir()
            .map_err(|e| format!("a temp dir: {e}"))?
            .keep();
        let watchdog = spawn_watchdog(&scripts.join("down"), &dir)?;
        let plane = ControlPlane {
            kubeconfig: dir.join("kubeconfig"),
            dir,
            scripts,
            watchdog: Some(watchdog),
        };
        let began = Instant::now();
        let up = plane.run_up()?;
        if !up.status.success() {
            return Err(format!(
                "{} failed ({}): {}",
                plane.scripts.join("up").display(),
                up.status,
                String::from_utf8_lossy(&up.stderr)
            ));
        }
        println!(
            "cluster tests: a control plane in {} was ready in {:.1} s",
            plane.dir.display(),
            began.elapsed().as_secs_f64()
        );
        Ok(plane)
    }

    fn run_up(&self) -> Result<Output, String> {
        Command::new(self.scripts.join("up"))
            .arg(&self.dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run {}: {e}", self.scripts.join("up").display()))
    }

    /// The directory `up` keeps everything in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The admin kubeconfig (a client certificate in `system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Every request the API server answered, one JSON object a line.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("logs/audit.log")
    }

    /// A client with the admin credentials.
    pub async fn client(&self) -> Client {
        client_for(&self.kubeconfig).await
    }

    /// `kubectl --kubeconfig <admin> ARGS`, as it ended.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run kubectl: {e}"))
    }

    /// `kubectl ARGS` that must succeed: its standard output.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let output = self.kubectl(args);
        assert!(
            output.status.success(),
            "kubectl {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The CRDs in `dir` applied server-side (taking over fields another
    /// manager holds) and Established.
    pub fn install_crds_from(&self, dir: &Path) {
        self.kubectl_ok(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            &dir.to_string_lossy(),
        ]);
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "crd/instancegenerations.genswap.dev",
            "crd/swapattempts.genswap.dev",
            "--timeout=60s",
        ]);
    }

    /// [`ControlPlane::install_crds_from`] this workspace's `crds/`.
    pub fn install_crds(&self) {
        self.install_crds_from(&workspace().join("crds"));
    }

    /// Creates the Node `name` with `labels` (and `kubernetes.io/hostname`
    /// set to its name): an object only, no kubelet runs it.
    pub async fn create_node(&self, name: &str, labels: &[(&str, &str)]) -> Node {
        let mut all: serde_json::Map<String, serde_json::Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).into()))
            .collect();
        all.insert("kubernetes.io/hostname".into(), name.into());
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": all},
        }))
        .unwrap_or_else(|e| panic!("a Node object: {e}"));
        Api::<Node>::all(self.client().await)
            .create(&PostParams::default(), &node)
            .await
            .unwrap_or_else(|e| panic!("create the Node {name}: {e}"))
    }

    /// A kubeconfig for ServiceAccount `namespace/name`, with a token from
    /// the TokenRequest API. Bound to `node` when given (as a token
    /// projected into a pod on that node is: its user info carries
    /// `authentication.kubernetes.io/node-name`).
    pub fn service_account_kubeconfig(
        &self,
        namespace: &str,
        name: &str,
        node: Option<&Node>,
    ) -> PathBuf {
        let mut args = vec![
            "create".to_string(),
            "token".into(),
            name.into(),
            "-n".into(),
            namespace.into(),
            "--duration".into(),
            "24h".into(),
        ];
        let mut file = format!("{namespace}.{name}");
        if let Some(node) = node {
            let node_name = node.metadata.name.clone().unwrap_or_default();
            args.extend([
                "--bound-object-kind".into(),
                "Node".into(),
                "--bound-object-name".into(),
                node_name.clone(),
                "--bound-object-uid".into(),
                node.metadata.uid.clone().unwrap_or_default(),
            ]);
            file.push_str(&format!(".on.{node_name}"));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let token = self.kubectl_ok(&args).trim().to_string();
        let dir = self.dir.join("credentials");
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        // A file of its own per call: tests running at once may ask for
        // the same account, and kubectl config locks the file it writes.
        static CALLS: AtomicUsize = AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{file}.{call}.kubeconfig"));
        let path_text = path.to_string_lossy().into_owned();
        let ca = self.dir.join("pki/ca.crt").to_string_lossy().into_owned();
        let server = self.server();
        for step in [
            vec![
                "set-cluster",
                "test",
                "--server",
                &server,
                "--certificate-authority",
                &ca,
                "--embed-certs",
            ],
            vec!["set-credentials", name, "--token", &token],
            vec![
                "set-context",
                "test",
                "--cluster",
                "test",
                "--user",
                name,
                "--namespace",
                namespace,
            ],
            vec!["use-context", "test"],
        ] {
            let output = Command::new("kubectl")
                .args(["config", "--kubeconfig", &path_text])
                .args(&step)
                .output()
                .unwrap_or_else(|e| panic!("run kubectl config: {e}"));
            assert!(
                output.status.success(),
                "kubectl config {} failed: {}",
                step[0],
                String::from_utf8_lossy(&output.stderr)
            );
        }
        path
    }

    /// The API server's URL.
    pub fn server(&self) -> String {
        let ports = fs::read_to_string(self.dir.join("ports")).unwrap_or_default();
        let api = ports.split_whitespace().nth(2).unwrap_or_default();
        format!("https://127.0.0.1:{api}")
    }

    /// Stops the API server (SIGTERM, SIGKILL after 30 s) by its pid file;
    /// etcd and the controller-manager keep running.
    pub fn stop_api_server(&self) {
        let pid_file = self.dir.join("run/kube-apiserver.pid");
        let pid: i32 = fs::read_to_string(&pid_file)
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or_else(|| panic!("no pid in {}", pid_file.display()));
        let binary = self.dir.join("bin/kube-apiserver");
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(
            String::from_utf8_lossy(&cmdline).contains(&*binary.to_string_lossy()),
            "pid {pid} is not this control plane's API server"
        );
        let pid = Pid::from_raw(pid);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = kill(pid, Signal::SIGKILL);
        let deadline = Instant::now() + RESTART_DEADLINE;
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                Instant::now() < deadline,
                "the API server {pid} did not stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the API server again and returns the instant `/readyz` first
    /// answered `ok`, polled every 50 ms while `up` runs.
    pub async fn start_api_server(&self) -> Instant {
        let mut up = Command::new(self.scripts.join("up"))
            .arg(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("run up: {e}"));
        let client = self.client().await;
        let deadline = Instant::now() + RESTART_DEADLINE;
        let ready = loop {
            let request = http_get("/readyz");
            let answer =
                tokio::time::timeout(Duration::from_secs(1), client.request_text(request)).await;
            if matches!(answer, Ok(Ok(ref body)) if body == "ok") {
                break Instant::now();
            }
            if let Ok(Some(status)) = up.try_wait()
                && !status.success()
            {
                panic!("up failed while restarting the API server ({status})");
            }
            assert!(
                Instant::now() < deadline,
                "the API server is not ready again"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let status = up.wait().unwrap_or_else(|e| panic!("wait for up: {e}"));
        assert!(
            status.success(),
            "up failed while restarting the API server ({status})"
        );
        ready
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some((mut watchdog, stdin)) = self.watchdog.take() {
            drop(stdin);
            let _ = watchdog.wait();
        }
    }
}

/// A client for the kubeconfig at `path`.
pub async fn client_for(path: &Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(path)
        .unwrap_or_else(|e| panic!("read the kubeconfig {}: {e}", path.display()));
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|e| panic!("the kubeconfig {}: {e}", path.display()));
    Client::try_from(config).unwrap_or_else(|e| panic!("a client: {e}"))
}

fn http_get(path: &str) -> http::Request<Vec<u8>> {
    http::Request::get(path)
        .body(Vec::new())
        .unwrap_or_else(|e| panic!("a request for {path}: {e}"))
}

/// Why no control plane can be started here, or `None` when one can.
fn why_absent() -> Option<String> {
    let up = scripts_dir().join("up");
    if !up.is_file() {
        return Some(format!(
            "{} not found; GENSWAP_KUBE_DIR names another directory",
            up.display()
        ));
    }
    TOOLS
        .iter()
        .find(|tool| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(|tool| format!("{} needs {tool}, which is not on PATH", up.display()))
}

/// `GENSWAP_KUBE_DIR`, else `<workspace>/../shared/kube`.
fn scripts_dir() -> PathBuf {
    match std::env::var_os("GENSWAP_KUBE_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => workspace().join("../shared/kube"),
    }
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// A shell, in a process group of its own (an interrupt of the test run
/// does not reach it), that tears `dir` down when its standard input
/// closes.
fn spawn_watchdog(down: &Path, dir: &Path) -> Result<(Child, ChildStdin), String> {
    let mut child = Command::new("sh")
        .args(["-c", "read -r _; exec \"$0\" \"$1\" --wipe"])
        .arg(down)
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("start the teardown watchdog: {e}"))?;
    let stdin = child
        .stdin
        .take()
        .ok_or_else(|| "the watchdog has no stdin".to_string())?;
    Ok((child, stdin))
}
