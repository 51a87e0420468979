//! spawn against the real cgroup v2 hierarchy with real processes, each test
//! in its own cgroup subtree.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::time::Duration;

use cgroup_guard::{TestCgroupTree, eventually};
use node_agent::cgroup::{Cgroup, Tier};
use node_agent::gate::InstanceKey;
use node_agent::spawn::{
    ActivatedSocket, ENV_BUILD, ENV_GENERATION, ENV_SOCKET, EXEC_BUSY_TRIES, Output, SetupStep,
    SpawnError, SpawnSpec, Spawned, VerifyError, spawn,
};

fn key(namespace: &str, name: &str) -> InstanceKey {
    InstanceKey::new(namespace, name).expect("a valid instance key")
}

const LONG: Duration = Duration::from_secs(30);
const NOBODY: u32 = 65534;

async fn generation(tree: &TestCgroupTree, n: u64) -> Cgroup {
    tree.manager()
        .instance(&key("default", "app"))
        .expect("instance")
        .create_generation(n, &Tier::default())
        .await
        .expect("fresh generation")
}

thread_local! {
    /// The test's instance run dir (each test runs on a thread of its
    /// own), removed when the test's thread ends, on failure too.
    static RUN: tempfile::TempDir = tempfile::tempdir().expect("a run dir");
}

/// Generation `n`'s socket in the test's run dir.
fn socket(n: u64) -> std::path::PathBuf {
    RUN.with(|run| run.path().join(format!("gen-{n}.sock")))
}

fn sh(cgroup: Cgroup, n: u64, script: &str) -> SpawnSpec {
    let mut spec = SpawnSpec::new("/bin/sh", cgroup, socket(n), n, "build-a");
    spec.args = vec!["-c".into(), script.into()];
    spec.uid = Some(NOBODY);
    spec.gid = Some(NOBODY);
    spec
}

fn proc_cgroup(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .expect("read /proc/<pid>/cgroup")
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        .expect("a cgroup v2 line")
}

fn status_field(pid: u32, field: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("read /proc/<pid>/status")
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{field}:"))
                .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| panic!("no {field} in status"))
}

fn env_names(pid: u32) -> BTreeSet<String> {
    fs::read(format!("/proc/{pid}/environ"))
        .expect("read environ")
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| {
            String::from_utf8_lossy(e.split(|b| *b == b'=').next().unwrap_or_default()).into_owned()
        })
        .collect()
}

#[tokio::test]
async fn the_process_and_what_it_forks_are_in_the_generation_cgroup() {
    let tree = TestCgroupTree::new("spawn-place");
    let cgroup = generation(&tree, 1).await;
    let expected = cgroup
        .proc_path()
        .expect("a real cgroup knows its /proc path")
        .to_owned();
    let spawned = spawn(sh(cgroup.clone(), 1, "sleep 1000 & wait"))
        .await
        .expect("spawned");

    eventually(LONG, "the shell and its child", || {
        cgroup.pids().map(|p| p.len() == 2).unwrap_or(false)
    })
    .await;
    let pids = cgroup.pids().expect("pids");
    assert!(pids.contains(&spawned.pid()));
    for pid in &pids {
        assert_eq!(proc_cgroup(*pid), expected, "pid {pid}");
    }
    let observed = spawned
        .verify()
        .expect("what started is what was asked for");
    assert_eq!(observed.cgroup, expected);
    assert_eq!(observed.generation.as_deref(), Some("1"));
    assert_eq!(observed.build.as_deref(), Some("build-a"));
    assert_eq!(spawned.generation(), 1);
    assert_eq!(spawned.build(), "build-a");
    assert_eq!(spawned.exe(), Path::new("/bin/sh"));
    assert_eq!(spawned.cgroup(), &cgroup);
}

#[tokio::test]
async fn the_environment_is_the_specs_plus_the_genswap_values_only() {
    let tree = TestCgroupTree::new("spawn-env");
    let cgroup = generation(&tree, 2).await;
    assert!(
        std::env::var_os("CARGO_MANIFEST_DIR").is_some(),
        "the test itself has an environment"
    );
    // sleep itself, not through a shell: a shell adds a PWD of its own.
    let mut spec = sh(cgroup, 2, "");
    spec.exe = PathBuf::from("/bin/sleep");
    spec.args = vec!["1000".into()];
    spec.env = vec![
        ("GREETING".into(), "hello".into()),
        (ENV_BUILD.into(), "forged".into()),
    ];
    let spawned = spawn(spec).await.expect("spawned");
    eventually(LONG, "the exec of sleep", || {
        spawned
            .observe()
            .map(|o| o.exe.ends_with("sleep"))
            .unwrap_or(false)
    })
    .await;

    let names = env_names(spawned.pid());
    let expected: BTreeSet<String> = ["GREETING", "PATH", ENV_SOCKET, ENV_GENERATION, ENV_BUILD]
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(names, expected);
    let observed = spawned.observe().expect("observe");
    assert_eq!(
        observed.build.as_deref(),
        Some("build-a"),
        "the spec cannot forge GENSWAP_BUILD"
    );
    assert_eq!(observed.socket.as_deref(), socket(2).to_str());
    assert_eq!(observed.generation.as_deref(), Some("2"));
}

#[tokio::test]
async fn ids_no_new_privs_and_a_new_session_are_applied() {
    let tree = TestCgroupTree::new("spawn-ids");
    let cgroup = generation(&tree, 3).await;
    let spawned = spawn(sh(cgroup, 3, "exec sleep 1000"))
        .await
        .expect("spawned");
    let pid = spawned.pid();
    assert_eq!(status_field(pid, "Uid"), "65534 65534 65534 65534");
    assert_eq!(status_field(pid, "Gid"), "65534 65534 65534 65534");
    assert_eq!(status_field(pid, "Groups"), "65534");
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let after_comm = stat.rsplit_once(')').expect("comm").1;
    let session: u32 = after_comm
        .split_whitespace()
        .nth(3)
        .expect("session")
        .parse()
        .expect("number");
    assert_eq!(session, pid, "its own session");
}

#[tokio::test]
async fn root_is_refused_before_anything_runs_unless_allowed() {
    let tree = TestCgroupTree::new("spawn-root");
    let cgroup = generation(&tree, 4).await;
    let mut explicit = sh(cgroup.clone(), 4, "exec sleep 1000");
    explicit.uid = Some(0);
    let err = spawn(explicit).await.expect_err("uid 0 refused");
    assert!(matches!(err, SpawnError::RootRefused { .. }), "{err:?}");
    assert!(err.is_refusal() && !err.may_have_run());
    assert!(err.to_string().contains("uid 0"), "{err}");

    let mut inherited = sh(cgroup.clone(), 4, "exec sleep 1000");
    inherited.uid = None;
    inherited.gid = None;
    let err = spawn(inherited)
        .await
        .expect_err("the agent's root is not inherited");
    assert!(err.to_string().contains("inherit the agent's"), "{err}");

    let mut group = sh(cgroup.clone(), 4, "exec sleep 1000");
    group.gid = Some(0);
    assert!(matches!(
        spawn(group).await,
        Err(SpawnError::RootRefused { .. })
    ));
    assert!(
        !cgroup.is_populated().expect("events"),
        "nothing was started"
    );

    let mut allowed = sh(cgroup.clone(), 4, "exec sleep 1000");
    allowed.uid = None;
    allowed.gid = None;
    allowed.allow_root = true;
    let spawned = spawn(allowed).await.expect("root allowed");
    assert_eq!(status_field(spawned.pid(), "Uid"), "0 0 0 0");
}

#[tokio::test]
async fn an_exec_failure_is_the_builds_and_a_setup_failure_is_not() {
    let tree = TestCgroupTree::new("spawn-errors");
    let cgroup = generation(&tree, 5).await;
    let scratch = tempfile::tempdir().expect("temp dir");

    let mut missing = sh(cgroup.clone(), 5, "");
    missing.exe = scratch.path().join("no-such-build");
    let err = spawn(missing).await.expect_err("missing exe");
    assert!(
        matches!(&err, SpawnError::Exec { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
        "{err:?}"
    );
    assert!(err.is_build_failure() && !err.is_refusal() && !err.may_have_run());

    let not_executable = scratch.path().join("build");
    fs::write(&not_executable, b"#!/bin/sh\n").expect("write");
    fs::set_permissions(&not_executable, fs::Permissions::from_mode(0o644)).expect("chmod");
    let mut spec = sh(cgroup.clone(), 5, "");
    spec.exe = not_executable;
    let err = spawn(spec).await.expect_err("not executable");
    assert!(err.is_build_failure(), "{err:?}");

    let mut bad_dir = sh(cgroup.clone(), 5, "exec sleep 1000");
    bad_dir.working_dir = Some(scratch.path().join("missing-dir"));
    let err = spawn(bad_dir).await.expect_err("missing working dir");
    assert!(
        matches!(
            err,
            SpawnError::Setup {
                step: SetupStep::WorkingDir,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_refusal() && !err.is_build_failure());
    assert!(
        !cgroup.is_populated().expect("events"),
        "the child exited without exec"
    );

    let mut relative = sh(cgroup.clone(), 5, "");
    relative.exe = PathBuf::from("bin/sh");
    assert!(matches!(
        spawn(relative).await,
        Err(SpawnError::InvalidSpec { .. })
    ));
}

#[tokio::test]
async fn a_build_held_open_for_writing_is_exec_busy_and_runs_once_released() {
    let tree = TestCgroupTree::new("spawn-busy");
    let cgroup = generation(&tree, 10).await;
    let scratch = tempfile::tempdir().expect("temp dir");
    fs::set_permissions(scratch.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let build = scratch.path().join("build");
    fs::copy("/bin/sleep", &build).expect("copy sleep");
    // Open for writing, as a store copy is while it is written (or while a
    // child forked meanwhile still holds the descriptor).
    let writer = fs::OpenOptions::new()
        .write(true)
        .open(&build)
        .expect("open the build for writing");
    let mut spec = sh(cgroup.clone(), 10, "");
    spec.exe = build.clone();
    spec.args = vec!["1000".into()];

    let err = spawn(spec.clone()).await.expect_err("the file is busy");
    assert!(
        matches!(&err, SpawnError::ExecBusy { tries, .. } if *tries == EXEC_BUSY_TRIES),
        "{err:?}"
    );
    assert!(
        err.is_refusal() && !err.is_build_failure() && !err.may_have_run(),
        "{err}"
    );
    assert!(
        !cgroup.is_populated().expect("events"),
        "nothing was started"
    );

    drop(writer);
    let spawned = spawn(spec).await.expect("the released build starts");
    eventually(LONG, "the exec of the build", || {
        spawned
            .observe()
            .is_ok_and(|observed| observed.exe == build)
    })
    .await;
}

#[tokio::test]
async fn a_failure_to_join_the_cgroup_means_nothing_ran() {
    let scratch = tempfile::tempdir().expect("temp dir");
    let missing = Cgroup::at(scratch.path().join("gone"), None);
    let mut spec = SpawnSpec::new("/bin/sh", missing, "/run/x.sock", 6, "b");
    spec.uid = Some(NOBODY);
    spec.gid = Some(NOBODY);
    let err = spawn(spec).await.expect_err("no cgroup.procs to open");
    assert!(matches!(err, SpawnError::OpenCgroup { .. }), "{err:?}");
    assert!(err.is_refusal());

    // The directory opens but takes no process: the kernel refuses to
    // create the child there (clone3 into a directory that is no cgroup),
    // or, on the forked fallback, the child's write to cgroup.procs fails.
    let refusing = scratch.path().join("refusing");
    fs::create_dir(&refusing).expect("mkdir");
    symlink("/dev/full", refusing.join("cgroup.procs")).expect("symlink");
    let marker = scratch.path().join("ran");
    let mut spec = SpawnSpec::new(
        "/bin/touch",
        Cgroup::at(&refusing, None),
        "/run/x.sock",
        6,
        "b",
    );
    spec.args = vec![marker.display().to_string()];
    spec.allow_root = true;
    let err = spawn(spec).await.expect_err("the join fails in the child");
    assert!(
        matches!(
            err,
            SpawnError::Setup {
                step: SetupStep::JoinCgroup,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.is_refusal() && !err.may_have_run());
    assert!(!marker.exists(), "the build never ran");
}

#[tokio::test]
async fn the_exit_status_and_output_file_reach_the_caller() {
    let tree = TestCgroupTree::new("spawn-exit");
    let cgroup = generation(&tree, 7).await;
    let scratch = tempfile::tempdir().expect("temp dir");
    let log = scratch.path().join("out.log");
    let mut spec = sh(
        cgroup.clone(),
        7,
        "echo \"hello from $GENSWAP_GENERATION\"; exit 3",
    );
    spec.stdout = Output::Append(log.clone());
    let mut spawned = spawn(spec).await.expect("spawned");
    let status = tokio::time::timeout(LONG, spawned.wait())
        .await
        .expect("exits")
        .expect("status");
    assert_eq!(status.code(), Some(3));
    assert_eq!(spawned.try_wait().expect("cached"), Some(status));
    assert_eq!(spawned.wait().await.expect("again").code(), Some(3));
    assert_eq!(fs::read_to_string(&log).expect("log"), "hello from 7\n");

    let mut one_shot = spawn(sh(cgroup.clone(), 7, "exit 0"))
        .await
        .expect("spawned");
    assert!(one_shot.wait().await.expect("status").success());
    assert!(!cgroup.is_populated().expect("events"));
}

#[tokio::test]
async fn verify_notices_a_process_that_is_no_longer_the_build_started() {
    let tree = TestCgroupTree::new("spawn-verify");
    let cgroup = generation(&tree, 8).await;
    let spawned = spawn(sh(cgroup, 8, "exec sleep 1000"))
        .await
        .expect("spawned");
    eventually(LONG, "the exec of sleep", || {
        spawned
            .observe()
            .map(|o| o.exe.ends_with("sleep"))
            .unwrap_or(false)
    })
    .await;
    match spawned.verify() {
        Err(VerifyError::Mismatch { what, .. }) => assert_eq!(what, "executable"),
        other => panic!("expected an executable mismatch, got {other:?}"),
    }
}

#[tokio::test]
async fn a_dropped_handle_still_reaps_its_process() {
    let tree = TestCgroupTree::new("spawn-reap");
    let cgroup = generation(&tree, 9).await;
    let release = tempfile::tempdir().expect("temp dir");
    fs::set_permissions(release.path(), fs::Permissions::from_mode(0o755)).expect("chmod");
    let go = release.path().join("go");
    let mut spec = sh(
        cgroup.clone(),
        9,
        &format!("while [ ! -e {} ]; do sleep 0.05; done", go.display()),
    );
    // The test's temp dir, seen through the instance's private /tmp.
    if let Some(sandbox) = spec.sandbox.as_mut() {
        sandbox.writable_paths = vec![release.path().to_path_buf()];
    }
    let spawned: Spawned = spawn(spec).await.expect("spawned");
    let pid = spawned.pid();
    drop(spawned);
    fs::write(&go, b"").expect("release");
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    eventually(LONG, "the exited process to be reaped", || {
        !proc_dir.exists()
    })
    .await;
    assert!(!cgroup.is_populated().expect("events"));
}

fn environ(pid: u32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/environ"))
        .expect("read environ")
        .split(|b| *b == 0)
        .filter(|e| !e.is_empty())
        .map(|e| String::from_utf8_lossy(e).into_owned())
        .collect()
}

fn activated(name: &str, fd: impl Into<std::os::fd::OwnedFd>) -> ActivatedSocket {
    ActivatedSocket {
        name: name.into(),
        fd: std::sync::Arc::new(fd.into()),
    }
}

/// Socket activation as `sd_listen_fds(3)` reads it: the sockets at fds 3..
/// in order, `LISTEN_FDS`, `LISTEN_FDNAMES`, and `LISTEN_PID` the
/// generation's own pid, which only the child can know.
#[tokio::test]
async fn listeners_are_handed_over_at_fds_3_with_listen_pid_the_childs_own() {
    let tree = TestCgroupTree::new("spawn-listen");
    let cgroup = generation(&tree, 7).await;
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").expect("a TCP listener");
    let tcp_port = tcp.local_addr().expect("address").port();
    let dir = tempfile::tempdir().expect("temp dir");
    let unix = std::os::unix::net::UnixListener::bind(dir.path().join("admin.sock"))
        .expect("a unix listener");
    let mut spec = sh(cgroup, 7, "exec sleep 1000");
    spec.env = vec![("LISTEN_PID".into(), "1".into())];
    spec.listeners = vec![activated("web", tcp), activated("admin", unix)];
    let spawned = spawn(spec).await.expect("spawned");
    let pid = spawned.pid();
    // The exe link changes before the kernel has written the new
    // environment: wait for the environment itself.
    eventually(LONG, "the exec of sleep with its environment", || {
        spawned.observe().is_ok_and(|o| o.exe.ends_with("sleep"))
            && environ(pid).iter().any(|e| e.starts_with("LISTEN_FDS="))
    })
    .await;
    let env = environ(pid);
    for expected in [
        format!("LISTEN_PID={pid}"),
        "LISTEN_FDS=2".to_string(),
        "LISTEN_FDNAMES=web:admin".to_string(),
    ] {
        assert!(env.contains(&expected), "{expected} not in {env:?}");
    }
    assert_eq!(
        env.iter().filter(|e| e.starts_with("LISTEN_PID=")).count(),
        1,
        "the spec cannot forge LISTEN_PID: {env:?}"
    );
    let link = |fd: u32| fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok();
    let socket_inode = |path: Option<PathBuf>| {
        path.and_then(|p| p.to_str().map(str::to_owned))
            .filter(|p| p.starts_with("socket:"))
    };
    assert!(socket_inode(link(3)).is_some(), "{:?}", link(3));
    assert!(socket_inode(link(4)).is_some(), "{:?}", link(4));
    assert!(
        link(5).is_none(),
        "nothing else is handed over: {:?}",
        link(5)
    );
    // fd 3 is the TCP listener: its inode is the one this process holds.
    let tcp_inode = fs::read_to_string("/proc/net/tcp")
        .expect("/proc/net/tcp")
        .lines()
        .find(|line| {
            line.split_whitespace()
                .nth(1)
                .is_some_and(|local| local.ends_with(&format!(":{tcp_port:04X}")))
        })
        .and_then(|line| line.split_whitespace().nth(9).map(str::to_owned))
        .expect("the listener in /proc/net/tcp");
    assert_eq!(socket_inode(link(3)), Some(format!("socket:[{tcp_inode}]")));
}

#[tokio::test]
async fn an_exec_failure_with_listeners_is_still_the_builds() {
    let tree = TestCgroupTree::new("spawn-listen-exec");
    let cgroup = generation(&tree, 8).await;
    let scratch = tempfile::tempdir().expect("temp dir");
    let script = scratch.path().join("build");
    fs::write(&script, b"#!/nonexistent/sh\n").expect("write");
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut spec = sh(cgroup.clone(), 8, "");
    spec.exe = script;
    spec.listeners = vec![activated(
        "web",
        std::net::TcpListener::bind("127.0.0.1:0").expect("listener"),
    )];
    let err = spawn(spec).await.expect_err("no interpreter");
    assert!(
        matches!(err, SpawnError::MissingInterpreter { .. }),
        "{err:?}"
    );
    assert!(!cgroup.is_populated().expect("events"));
}
