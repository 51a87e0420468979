//! A whole node for one swap test: a unique cgroup v2 subtree, a staging
//! root, an artifact store, a run dir and a journal in one temp dir, the
//! engine over them, and testapp builds to stage. Everything is removed on
//! drop, after a panic too: the subtree is killed and removed by
//! [`TestCgroupTree`], the temp dir deleted.
//!
//! Include it after the cgroup guard:
//! `#[path = "support/cgroup_guard.rs"] mod cgroup_guard;`
//! `#[path = "support/swap_host.rs"] mod swap_host;`
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use genswap_crds::{
    Artifact, BuildSpec, Cause, Demand, EnvVar, HealthSpec, InstanceKind, Mode, ProcessSpec,
    SettleSpec, StopSignal, StopSpec, SwapAttemptSpec,
};
use genswap_store::{Stager, StagerConfig, Store};
use node_agent::engine::{Attempt, Cancel, Engine, EngineConfig, EngineParts, SwapResult};
use node_agent::gate::{AttemptGate, AttemptId, GatePoint, GateRefusal, InstanceKey};
use node_agent::journal::Journal;
use node_agent::logs::{LogSettings, LogSink};
use node_agent::switch::RunLayout;

use crate::cgroup_guard::{TestCgroupTree, instance_pids};

/// Generous: the machine is shared and may be slow.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// The uid and gid instances run as (`nobody`): not root.
pub const NOBODY: i64 = 65534;

/// One test's node.
pub struct SwapHost {
    pub engine: std::sync::Arc<Engine>,
    /// The engine's stager (the same store).
    pub stager: Stager,
    pub instance: InstanceKey,
    /// `<dir>/staging`: the staging root artifacts must be under.
    pub staging: PathBuf,
    pub run_dir: PathBuf,
    pub state_dir: PathBuf,
    tree: TestCgroupTree,
    // Dropped after the tree and before the dir: nothing runs from either.
    run_mount: Option<TmpfsMount>,
    dir: tempfile::TempDir,
}

impl Drop for SwapHost {
    fn drop(&mut self) {
        // Before the tree goes: no log shim is started ahead into it after.
        self.engine.logs().close();
    }
}

/// How a [`SwapHost`] differs from a plain one.
pub struct HostOptions {
    /// Its run dir on a tmpfs of its own, as a node's `/run` is (the temp
    /// dir may be on a disk): for figures that must be what a node shows.
    pub run_dir_in_memory: bool,
    /// What runs as the log shims and listener keepers.
    pub helper: &'static str,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            run_dir_in_memory: false,
            helper: HELPER,
        }
    }
}

/// The built helper (`genswap-helper`): the shims' and keepers' program.
pub const HELPER: &str = env!("CARGO_BIN_EXE_genswap-helper");

/// A tmpfs mounted by a test, taken down by its path on drop.
pub struct TmpfsMount(PathBuf);

impl TmpfsMount {
    /// Mounts a tmpfs at `at` (an existing directory) as a node's `/run` is:
    /// `nosuid,nodev`, mode 0755.
    pub fn mount(at: &Path) -> TmpfsMount {
        use nix::mount::{MsFlags, mount};
        mount(
            Some("genswap-test-run"),
            at,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=0755"),
        )
        .expect("mount a tmpfs (the tests run as root)");
        TmpfsMount(at.to_path_buf())
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

impl SwapHost {
    /// A node with swaps on and root instances refused.
    pub fn new(tag: &str) -> SwapHost {
        SwapHost::with_config(tag, EngineConfig::default())
    }

    pub fn with_config(tag: &str, config: EngineConfig) -> SwapHost {
        SwapHost::in_tree(tag, config, TestCgroupTree::new(tag))
    }

    /// [`SwapHost::new`] with its run dir on a tmpfs of its own, as a
    /// node's `/run` is (the temp dir may be on a disk): for figures that
    /// must be what a node would show.
    pub fn with_run_dir_in_memory(tag: &str) -> SwapHost {
        SwapHost::with_options(
            tag,
            HostOptions {
                run_dir_in_memory: true,
                ..HostOptions::default()
            },
        )
    }

    /// [`SwapHost::new`] as `options` say.
    pub fn with_options(tag: &str, options: HostOptions) -> SwapHost {
        SwapHost::in_tree_staging(
            tag,
            EngineConfig::default(),
            TestCgroupTree::new(tag),
            |_| {},
            options,
        )
    }

    /// A node whose agent's cgroup root is `<tree>/genswap`.
    pub fn in_tree(tag: &str, config: EngineConfig, tree: TestCgroupTree) -> SwapHost {
        SwapHost::in_tree_staging(tag, config, tree, |_| {}, HostOptions::default())
    }

    /// A node whose stager is configured by `tune` (registries, limits).
    pub fn with_stager(tag: &str, tune: impl FnOnce(&mut StagerConfig)) -> SwapHost {
        SwapHost::in_tree_staging(
            tag,
            EngineConfig::default(),
            TestCgroupTree::new(tag),
            tune,
            HostOptions::default(),
        )
    }

    fn in_tree_staging(
        tag: &str,
        config: EngineConfig,
        tree: TestCgroupTree,
        tune: impl FnOnce(&mut StagerConfig),
        options: HostOptions,
    ) -> SwapHost {
        let dir = tempfile::Builder::new()
            .prefix(&format!("genswap-{tag}-"))
            .tempdir()
            .expect("temp dir");
        // Instances run as nobody: they must reach the store and the run dir.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))
            .expect("open the temp dir to the instance's uid");
        let staging = dir.path().join("staging");
        let run_dir = dir.path().join("run");
        let state_dir = dir.path().join("state");
        fs::create_dir(&staging).expect("staging root");
        let run_mount = options.run_dir_in_memory.then(|| {
            fs::create_dir(&run_dir).expect("the run dir");
            TmpfsMount::mount(&run_dir)
        });
        let mut stager_config = StagerConfig::new(&staging);
        tune(&mut stager_config);
        let stager = Stager::new(
            Store::open(dir.path().join("store")).expect("store"),
            stager_config,
        )
        .expect("stager");
        let cgroups = tree.manager();
        let logs = LogSink::new(
            LogSettings::in_dir(dir.path().join("logs"), options.helper),
            &cgroups,
        )
        .expect("log sink");
        let parts = EngineParts {
            cgroups,
            layout: RunLayout::new(&run_dir),
            stager: stager.clone(),
            journal: Journal::open(&state_dir).expect("journal"),
            logs,
        };
        SwapHost {
            engine: std::sync::Arc::new(Engine::new(parts, config)),
            stager,
            instance: InstanceKey::new("default", "app").expect("instance key"),
            staging,
            run_dir,
            state_dir,
            tree,
            run_mount,
            dir,
        }
    }

    /// A distinct testapp build in the staging root.
    pub fn build(&self, name: &str) -> testapp::Build {
        testapp_build(&self.staging, name)
    }

    /// An overlap attempt of `build` with schedRev `rev`: no settle window,
    /// generous deadlines, run as nobody.
    pub fn attempt(&self, rev: i64, build: &testapp::Build, id: &str) -> Attempt {
        Attempt {
            instance: self.instance.clone(),
            name: format!("app-node-a-{rev}"),
            spec: spec(rev, build, id),
            restart: None,
        }
    }

    /// An overlap attempt of `build` (a tree, an image): the spec
    /// [`SwapHost::attempt`] makes, with this build in place of a file.
    pub fn attempt_of(&self, rev: i64, build: BuildSpec) -> Attempt {
        let none = testapp::Build {
            path: PathBuf::new(),
            sha256: String::new(),
        };
        let mut attempt = self.attempt(rev, &none, &build.id);
        attempt.spec.build = build;
        attempt
    }

    /// Runs `attempt` with a gate that always passes.
    pub async fn swap(&self, attempt: &Attempt) -> SwapResult {
        self.engine.swap(attempt, &OpenGate, &Cancel::new()).await
    }

    /// Installs build `name` and checks it serves.
    pub async fn install(&self, rev: i64, name: &str) -> testapp::Build {
        self.install_with(rev, name, |_| {}).await
    }

    /// Installs build `name`, its attempt changed by `tune` first.
    pub async fn install_with(
        &self,
        rev: i64,
        name: &str,
        tune: impl FnOnce(&mut Attempt),
    ) -> testapp::Build {
        let build = self.build(name);
        let mut attempt = self.attempt(rev, &build, name);
        tune(&mut attempt);
        let result = self.swap(&attempt).await;
        assert_eq!(
            result.outcome,
            genswap_crds::Outcome::Done,
            "install of {name}: {result:?}"
        );
        build
    }

    /// `<run>/<ns>.<name>/current.sock`.
    pub fn current_sock(&self) -> PathBuf {
        self.engine.layout().current_socket(&self.instance)
    }

    /// Who answers through `current.sock` now; `None` when nobody does.
    pub async fn who_serves(&self) -> Option<Identity> {
        ask(&self.current_sock()).await
    }

    /// The test's cgroup subtree (the agent's root is `<it>/genswap`).
    pub fn tree_path(&self) -> &Path {
        self.tree.path()
    }

    /// The instance's cgroup directory.
    pub fn instance_cgroup(&self) -> PathBuf {
        self.tree
            .path()
            .join("genswap")
            .join(node_agent::disk_name::DiskName::of(&self.instance))
    }

    /// The instance's listener keeper cgroup.
    pub fn keeper_cgroup(&self) -> PathBuf {
        self.tree
            .path()
            .join("genswap")
            .join(node_agent::cgroup::KEEPER_CGROUP)
            .join(node_agent::disk_name::DiskName::of(&self.instance))
    }

    /// The pids in the instance's listener keeper cgroup.
    pub fn keeper_pids(&self) -> Vec<u32> {
        instance_pids(&self.keeper_cgroup())
    }

    /// The `gen-<N>` cgroups that exist, ascending.
    pub fn generation_cgroups(&self) -> Vec<u64> {
        let mut found: Vec<u64> = fs::read_dir(self.instance_cgroup())
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter_map(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(|n| n.strip_prefix("gen-"))
                            .and_then(|n| n.parse().ok())
                    })
                    .collect()
            })
            .unwrap_or_default();
        found.sort_unstable();
        found
    }

    /// Every instance pid anywhere in the test's cgroup subtree.
    pub fn pids_in_tree(&self) -> Vec<u32> {
        instance_pids(self.tree.path())
    }

    /// The generation sockets in the instance's run dir.
    pub fn generation_sockets(&self) -> Vec<u64> {
        self.engine
            .layout()
            .generation_sockets(&self.instance)
            .expect("read the run dir")
    }

    /// Asserts that exactly `generation` is left: one `gen-<N>` cgroup, one
    /// socket, and processes only in that cgroup (or nothing at all for
    /// `None`).
    pub fn assert_only(&self, generation: Option<u64>) {
        let expected: Vec<u64> = generation.into_iter().collect();
        assert_eq!(
            self.generation_cgroups(),
            expected,
            "generation cgroups left"
        );
        assert_eq!(
            self.generation_sockets(),
            expected,
            "generation sockets left"
        );
        match generation {
            None => assert_eq!(self.pids_in_tree(), Vec::<u32>::new(), "processes left"),
            Some(n) => {
                let inside = instance_pids(&self.instance_cgroup().join(format!("gen-{n}")));
                let everywhere = self.pids_in_tree();
                assert_eq!(everywhere, inside, "processes outside generation {n}");
                assert!(!inside.is_empty(), "generation {n} runs no process");
            }
        }
    }

    /// A host where build `b1` serves as generation 1, and attempt 2 that
    /// releases build `b2` on it.
    pub async fn serving_b1_releasing_b2(tag: &str) -> (SwapHost, Attempt) {
        let host = SwapHost::new(tag);
        host.install(1, "b1").await;
        let b2 = host.build("b2");
        let attempt = host.attempt(2, &b2, "b2");
        (host, attempt)
    }

    /// Asserts that `before` still answers and is all that is left.
    pub async fn assert_still_serves(&self, before: &Identity) {
        assert_eq!(
            self.who_serves().await.as_ref(),
            Some(before),
            "the incumbent serves"
        );
        self.assert_only(Some(before.generation));
    }

    /// A second engine over this host's directories and cgroup subtree:
    /// the next agent after this one was stopped or killed.
    pub fn next_agent(&self, config: EngineConfig) -> std::sync::Arc<Engine> {
        let cgroups = self.tree.manager();
        let logs = test_log_sink(&self.log_dir(), &cgroups);
        let parts = EngineParts {
            logs,
            cgroups,
            layout: RunLayout::new(&self.run_dir),
            stager: Stager::new(
                Store::open(self.dir.path().join("store")).expect("store"),
                StagerConfig::new(&self.staging),
            )
            .expect("stager"),
            journal: Journal::open(&self.state_dir).expect("journal"),
        };
        std::sync::Arc::new(Engine::new(parts, config))
    }

    /// Stops what serves and checks nothing is left in the subtree.
    pub async fn tear_down(&self) {
        self.engine
            .stop_instance(&self.instance, &StopSpec::default())
            .await
            .expect("stop the instance");
        self.assert_only(None);
    }
}

/// Archives the contents of `src` into `archive` with the real GNU tar
/// (gzip or zstd by its own flags) and returns the archive's sha256.
pub fn tar_tree(src: &Path, archive: &Path, format: genswap_crds::Unpack) -> String {
    let mut tar = Command::new("tar");
    tar.arg("-C").arg(src).arg("-cf").arg(archive);
    match format {
        genswap_crds::Unpack::Tar => {}
        genswap_crds::Unpack::TarGzip => {
            tar.arg("--gzip");
        }
        genswap_crds::Unpack::TarZstd => {
            tar.arg("--zstd");
        }
    }
    let status = tar.arg(".").status().expect("run tar");
    assert!(status.success(), "tar of {} failed", src.display());
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(
        fs::read(archive).expect("read the archive"),
    ))
}

/// A tree build of the archive at `archive` (`format`), running
/// `entrypoint` inside it.
pub fn archive_build(
    id: &str,
    archive: &Path,
    sha256: &str,
    format: genswap_crds::Unpack,
    entrypoint: &str,
) -> BuildSpec {
    BuildSpec {
        signed_by: None,
        signature: None,
        id: id.into(),
        artifact: Artifact {
            path: Some(archive.display().to_string()),
            url: None,
            image: None,
            unpack: Some(format),
        },
        sha256: sha256.into(),
        entrypoint: Some(entrypoint.into()),
    }
}

/// A SwapAttempt spec for `build`: overlap, no canary, health within 20 s,
/// stop within 10 s, run as nobody.
pub fn spec(rev: i64, build: &testapp::Build, id: &str) -> SwapAttemptSpec {
    SwapAttemptSpec {
        instance: "app".into(),
        node_name: "node-a".into(),
        sched_rev: rev,
        cause: Cause::Release,
        kind: InstanceKind::Instance,
        build: BuildSpec {
            signed_by: None,
            signature: None,
            id: id.into(),
            artifact: Artifact {
                path: Some(build.path.display().to_string()),
                url: None,
                image: None,
                unpack: None,
            },
            sha256: build.sha256.clone(),
            entrypoint: None,
        },
        mode: Mode::Overlap,
        demand: Demand::None,
        config_rev: String::new(),
        restart_id: String::new(),
        canary: false,
        process: ProcessSpec {
            user: Some(NOBODY),
            group: Some(NOBODY),
            ..ProcessSpec::default()
        },
        health: HealthSpec {
            path: Some("/".into()),
            timeout_seconds: 20,
            ..HealthSpec::default()
        },
        liveness: None,
        lifecycle: None,
        settle: SettleSpec {
            seconds: 1,
            all_nodes: false,
        },
        stop: StopSpec {
            signal: StopSignal::Term,
            timeout_seconds: 10,
        },
        resources: Default::default(),
        socket: Default::default(),
        listeners: Vec::new(),
        restart_policy: None,
        sidecars: Vec::new(),
        stage_only: false,
    }
}

/// Adds a testapp knob to the attempt's environment.
pub fn knob(attempt: &mut Attempt, name: &str, value: &str) {
    attempt.spec.process.env.push(EnvVar {
        name: name.into(),
        value: value.into(),
    });
}

/// Lets the instance write `dir` (`process.writablePaths`): a test's files
/// lie in its temp dir, which the default sandbox's private /tmp hides.
pub fn writable(attempt: &mut Attempt, dir: &Path) {
    attempt
        .spec
        .process
        .writable_paths
        .push(dir.display().to_string());
}

/// Asserts that `text` contains each of `says`.
pub fn assert_says(text: &str, says: &[&str]) {
    for words in says {
        assert!(text.contains(words), "{words:?} not in {text:?}");
    }
}

/// What a generation says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub status: u16,
    pub build: String,
    pub generation: u64,
    pub pid: u32,
}

/// `GET /` on `socket`; `None` when nothing answers.
pub async fn ask(socket: &Path) -> Option<Identity> {
    let (status, body) = node_agent::health::get_within(socket, "/", Duration::from_secs(10))
        .await
        .ok()?;
    parse_identity(status, &String::from_utf8_lossy(&body))
}

/// Parses `build=… generation=… pid=…`.
pub fn parse_identity(status: u16, body: &str) -> Option<Identity> {
    let mut build = None;
    let mut generation = None;
    let mut pid = None;
    for field in body.split_whitespace() {
        match field.split_once('=') {
            Some(("build", v)) => build = Some(v.to_string()),
            Some(("generation", v)) => generation = v.parse().ok(),
            Some(("pid", v)) => pid = v.parse().ok(),
            _ => {}
        }
    }
    Some(Identity {
        status,
        build: build?,
        generation: generation?,
        pid: pid?,
    })
}

/// A gate that passes everywhere.
pub struct OpenGate;

impl AttemptGate for OpenGate {
    fn check(&self, _point: GatePoint, _attempt: &AttemptId) -> Result<(), GateRefusal> {
        Ok(())
    }
}

/// A gate that says a newer attempt exists from `point` on, and remembers
/// where it was asked.
pub struct SupersedeAt {
    pub point: GatePoint,
    pub asked: Mutex<Vec<GatePoint>>,
}

impl SupersedeAt {
    pub fn new(point: GatePoint) -> Self {
        Self {
            point,
            asked: Mutex::new(Vec::new()),
        }
    }

    pub fn asked(&self) -> Vec<GatePoint> {
        self.asked.lock().expect("gate log").clone()
    }
}

impl AttemptGate for SupersedeAt {
    fn check(&self, point: GatePoint, attempt: &AttemptId) -> Result<(), GateRefusal> {
        self.asked.lock().expect("gate log").push(point);
        if point == self.point {
            Err(GateRefusal::Superseded {
                newest: attempt.sched_rev + 1,
            })
        } else {
            Ok(())
        }
    }
}

/// A log sink writing under `dir`, whose shims are the built `genswap-helper`.
pub fn test_log_sink(dir: &Path, cgroups: &node_agent::cgroup::CgroupManager) -> LogSink {
    LogSink::new(LogSettings::in_dir(dir, HELPER), cgroups).expect("log sink")
}

impl SwapHost {
    /// The log dir this host's engine writes under.
    pub fn log_dir(&self) -> PathBuf {
        self.run_dir.with_file_name("logs")
    }
}

/// Whether `pid` is alive (a zombie counts as gone).
pub fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
                .unwrap_or(false)
        })
        .unwrap_or(false)
}

/// Polls `condition` until it holds or the deadline passes.
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A testapp build at `dir/name`, building the server first when this
/// profile has not built it (a `cargo test -p node-agent` on its own).
pub fn testapp_build(dir: &Path, name: &str) -> testapp::Build {
    static BUILT: Mutex<()> = Mutex::new(());
    let _one_at_a_time = BUILT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match testapp::make_build(dir, name) {
        Ok(build) => build,
        Err(testapp::Error::NotBuilt { path }) => {
            build_testapp(&path);
            testapp::make_build(dir, name).expect("a testapp build after building the server")
        }
        Err(error) => panic!("making testapp build {name}: {error}"),
    }
}

/// `cargo build -p testapp` into the target dir `missing` is expected in.
fn build_testapp(missing: &Path) {
    let profile_dir = missing.parent().expect("a profile dir");
    let target_dir = profile_dir.parent().expect("a target dir");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args([
            "build",
            "-q",
            "-p",
            "testapp",
            "--bin",
            testapp::BINARY_NAME,
        ])
        .arg("--target-dir")
        .arg(target_dir);
    if profile_dir.file_name().is_some_and(|p| p == "release") {
        command.arg("--release");
    }
    let status = command.status().expect("run cargo build -p testapp");
    assert!(status.success(), "cargo build -p testapp failed: {status}");
}
