//! The e2e harness: finding the cluster, the host requirements, building and
//! running the binaries, and cleaning up after them whatever happens (Drop
//! guards: processes by PID, the cgroup subtree by path, the namespace by
//! name, the temp dir).

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kube::Client;
use kube::config::{Config, KubeConfigOptions};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The line printed, and the only output, when there is no cluster.
pub const SKIP_LINE: &str = "e2e: skipped: no reachable cluster in KUBECONFIG";

/// How long a single API request or reachability probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// A client for the cluster `KUBECONFIG` names, or why there is none.
pub async fn reachable_cluster() -> Result<Client, String> {
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
    Ok(client)
}

/// The single kubeconfig file `KUBECONFIG` names, when it names one.
pub fn single_kubeconfig() -> Option<PathBuf> {
    let value = std::env::var("KUBECONFIG").ok()?;
    (!value.contains(':') && !value.is_empty()).then(|| PathBuf::from(value))
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
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e lies inside the workspace")
        .to_path_buf()
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
/// `testapp::make_build` finds the test app beside it).
pub fn build_binaries() -> Binaries {
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
}

/// A process the suite started; stopped by PID on drop (SIGTERM, then
/// SIGKILL after 30 s), its log kept for diagnosis.
pub struct ChildGuard {
    /// For messages.
    pub name: &'static str,
    child: Child,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

impl ChildGuard {
    /// Starts `command` with its output in `log`.
    pub fn spawn(name: &'static str, mut command: Command, log: PathBuf) -> Self {
        let file = fs::File::create(&log).expect("create a log file");
        let err = file.try_clone().expect("clone the log file");
        let child = command
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        ChildGuard { name, child, log }
    }

    /// Panics when the process has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "{} exited ({status}); its log:\n{}",
                self.name,
                tail(&self.log, 60)
            );
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let Ok(raw) = i32::try_from(self.child.id()) else {
            return;
        };
        let _ = kill(Pid::from_raw(raw), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
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
}

impl Drop for NamespaceGuard {
    fn drop(&mut self) {
        let _ = Command::new("kubectl")
            .args([
                "delete",
                "namespace",
                &self.name,
                "--wait=false",
                "--ignore-not-found",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Runs kubectl, panicking with its output when it fails.
pub fn kubectl(args: &[&str]) -> String {
    let output = Command::new("kubectl")
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
