//! The cgroup manager against the real cgroup v2 hierarchy of this host,
//! each test in its own subtree.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;

use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cgroup_guard::{TestCgroupTree, eventually, start_in};
use nix::sys::signal::Signal;
use node_agent::cgroup::{
    Cgroup, CgroupError, CgroupManager, Controller, InstanceCgroup, PREFERRED_MOUNT, Tier,
    cgroup2_mounts, discover_mount,
};
use node_agent::disk_name::DiskName;
use node_agent::gate::InstanceKey;
use tokio::time::Instant;

fn key(namespace: &str, name: &str) -> InstanceKey {
    InstanceKey::new(namespace, name).expect("a valid instance key")
}

const LONG: Duration = Duration::from_secs(30);

/// The instance `default/app`'s cgroup in `tree`.
fn app(tree: &TestCgroupTree) -> InstanceCgroup {
    tree.manager()
        .instance(&key("default", "app"))
        .expect("instance cgroup")
}

/// `default/app` and its generation `n`'s fresh cgroup, with no limits.
async fn app_generation(tree: &TestCgroupTree, n: u64) -> (InstanceCgroup, Cgroup) {
    let instance = app(tree);
    let generation = instance
        .create_generation(n, &Tier::default())
        .await
        .expect("generation cgroup");
    (instance, generation)
}

#[test]
fn discovery_finds_this_hosts_cgroup2_mount() {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    let mounts = cgroup2_mounts(&mountinfo);
    let expected = mounts
        .iter()
        .find(|m| m.as_path() == Path::new(PREFERRED_MOUNT))
        .or(mounts.first())
        .expect("this host mounts cgroup v2")
        .clone();
    let mount = discover_mount().expect("discovery succeeds here");
    assert_eq!(mount, expected);
    assert!(
        mount.join("cgroup.procs").exists(),
        "{} is a cgroup v2 root",
        mount.display()
    );
    let controllers = fs::read_to_string(mount.join("cgroup.controllers"));
    assert!(controllers.is_ok(), "cgroup.controllers is readable");
}

#[test]
fn an_explicit_root_outside_cgroup2_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let err =
        CgroupManager::open(dir.path().join("genswap")).expect_err("a tmp dir is not cgroup2");
    assert!(matches!(err, CgroupError::NotCgroup2 { .. }), "{err:?}");
    assert!(
        err.to_string().contains("is not in a cgroup v2 filesystem"),
        "{err}"
    );

    let err = CgroupManager::open("relative/genswap").expect_err("a relative root");
    assert!(matches!(err, CgroupError::InvalidRoot { .. }), "{err:?}");
    let mount = discover_mount().expect("mount");
    let err = CgroupManager::open(mount.join("a/../b")).expect_err(".. in the root");
    assert!(matches!(err, CgroupError::InvalidRoot { .. }), "{err:?}");
}

#[tokio::test]
async fn layout_is_root_instance_generation() {
    let tree = TestCgroupTree::new("layout");
    let manager = tree.manager();
    let instance = manager
        .instance(&key("default", "web.app"))
        .expect("instance cgroup");
    assert_eq!(instance.path(), tree.path().join("genswap/default.web.app"));
    assert!(
        instance.path().join("cgroup.procs").exists(),
        "the instance dir is a cgroup"
    );

    let generation = instance
        .create_generation(7, &Tier::default())
        .await
        .expect("a fresh generation");
    assert_eq!(generation.path(), instance.path().join("gen-7"));
    assert!(!generation.is_populated().expect("events"));
    assert_eq!(generation.pids().expect("procs"), Vec::<u32>::new());
    let relative = generation
        .path()
        .strip_prefix(tree.mount())
        .expect("under the mount");
    assert_eq!(
        generation.proc_path(),
        Some(format!("/{}", relative.display()).as_str())
    );

    // The longest key Kubernetes allows gets a cut name the kernel takes.
    let longest = key(&"n".repeat(63), &"a".repeat(253));
    let long = manager.instance(&longest).expect("a cut instance cgroup");
    let dir_name = DiskName::of(&longest).as_str().to_owned();
    assert_eq!(long.path(), tree.path().join("genswap").join(&dir_name));
    let listed: Vec<String> = manager
        .list()
        .expect("list")
        .into_iter()
        .map(|listing| listing.dir_name)
        .collect();
    assert_eq!(listed, vec!["default.web.app".to_owned(), dir_name]);
}

#[tokio::test]
async fn a_requested_limit_without_its_controller_refuses_before_anything_exists() {
    let tree = TestCgroupTree::new("limit");
    let instance = app(&tree);
    let subtree = fs::read_to_string(instance.path().join("cgroup.subtree_control"))
        .expect("subtree_control");
    let tier = Tier {
        memory_max_bytes: Some(64 << 20),
        ..Tier::default()
    };
    if subtree.split_whitespace().any(|c| c == "memory") {
        // A host whose v2 hierarchy has memory: the limit is applied instead.
        let generation = instance.create_generation(1, &tier).await.expect("applied");
        let written = fs::read_to_string(generation.path().join("memory.max")).expect("memory.max");
        assert_eq!(written.trim(), (64u64 << 20).to_string());
        return;
    }
    let err = instance
        .create_generation(1, &tier)
        .await
        .expect_err("memory is not enabled in this host's cgroup v2 tree");
    match &err {
        CgroupError::LimitNotApplied {
            controller, path, ..
        } => {
            assert_eq!(*controller, Controller::Memory);
            assert_eq!(path, &instance.path().join("gen-1"));
        }
        other => panic!("expected LimitNotApplied, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.starts_with("memory limit cannot be applied"),
        "{message}"
    );
    assert!(
        message.contains("memory.max cannot be applied"),
        "{message}"
    );
    assert!(
        !instance.path().join("gen-1").exists(),
        "nothing was created"
    );
    assert!(instance.generations().expect("list").is_empty());
}

#[tokio::test]
async fn stop_proves_exit_of_a_process_that_obeys_the_signal() {
    let tree = TestCgroupTree::new("stop-term");
    let (_instance, generation) = app_generation(&tree, 1).await;
    let mut child = start_in(generation.path(), "exec sleep 1000");
    eventually(LONG, "the process in its cgroup", || {
        generation.pids().map(|p| p.len() == 1).unwrap_or(false)
    })
    .await;

    let report = generation
        .stop(Signal::SIGTERM, LONG)
        .await
        .expect("stopped");
    assert!(!report.killed, "{report:?}");
    assert_eq!(report.signalled, 1);
    assert!(report.drain < LONG);
    assert!(!generation.is_populated().expect("events"));
    let status = child.wait().await.expect("reaped");
    assert_eq!(status.signal(), Some(Signal::SIGTERM as i32));
}

#[tokio::test]
async fn stop_kills_a_tree_that_ignores_the_signal_at_the_timeout() {
    let tree = TestCgroupTree::new("stop-kill");
    let markers = tempfile::tempdir().expect("temp dir");
    let (_instance, generation) = app_generation(&tree, 1).await;
    // Both the shell and the grandchild it forks ignore SIGTERM (and so do
    // their sleeps, which inherit SIG_IGN); each leaves a marker once its
    // trap is set, so the signal cannot arrive before it.
    let script = format!(
        r#"trap '' TERM; /bin/sh -c "trap '' TERM; touch {dir}/grandchild; while :; do sleep 1; done" & touch {dir}/parent; while :; do sleep 1; done"#,
        dir = markers.path().display()
    );
    let _child = start_in(generation.path(), &script);
    let (parent, grandchild) = (
        markers.path().join("parent"),
        markers.path().join("grandchild"),
    );
    eventually(LONG, "both traps set", || {
        parent.exists() && grandchild.exists()
    })
    .await;
    let before = generation.pids().expect("pids");
    assert!(before.len() >= 2, "parent and grandchild: {before:?}");

    let timeout = Duration::from_millis(500);
    let report = generation
        .stop(Signal::SIGTERM, timeout)
        .await
        .expect("stopped");
    assert!(report.killed, "{report:?}");
    assert!(report.drain >= timeout, "{report:?}");
    assert!(report.signalled >= 2, "{report:?}");
    assert!(!generation.is_populated().expect("events"));
    assert!(generation.pids().expect("pids").is_empty());
    for pid in before {
        assert!(!running(pid), "pid {pid} is gone or a zombie");
    }
    generation.remove().expect("an empty generation is removed");
    assert!(!generation.exists());
}

/// A pid that still executes (exists and is not a zombie awaiting reaping).
fn running(pid: u32) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    !status
        .lines()
        .any(|line| line.starts_with("State:") && line.contains("Z (zombie)"))
}

#[tokio::test]
async fn wait_empty_wakes_when_the_last_process_exits() {
    let tree = TestCgroupTree::new("wait");
    let (_instance, generation) = app_generation(&tree, 1).await;
    let release = tempfile::tempdir().expect("temp dir");
    let go = release.path().join("go");
    let script = format!("while [ ! -e {} ]; do sleep 0.05; done", go.display());
    let mut child = start_in(generation.path(), &script);
    eventually(LONG, "the process in its cgroup", || {
        generation.is_populated().unwrap_or(false)
    })
    .await;

    // A short deadline on a live generation ends false.
    let short = generation
        .wait_empty(Instant::now() + Duration::from_millis(200))
        .await
        .expect("wait");
    assert!(!short, "still populated");

    let waiter = {
        let generation = generation.clone();
        tokio::spawn(async move { generation.wait_empty(Instant::now() + LONG).await })
    };
    tokio::task::yield_now().await;
    assert!(!waiter.is_finished(), "it waits while the process lives");
    fs::write(&go, b"").expect("release the process");
    let emptied = waiter.await.expect("join").expect("wait");
    assert!(emptied, "woke on exit before the deadline");
    assert!(child.wait().await.expect("reaped").success());
}

#[tokio::test]
async fn kill_ends_a_forking_tree_with_proof() {
    let tree = TestCgroupTree::new("kill");
    let (_instance, generation) = app_generation(&tree, 3).await;
    let _child = start_in(generation.path(), "sleep 1000 & sleep 1000 & wait");
    eventually(LONG, "three processes", || {
        generation.pids().map(|p| p.len() == 3).unwrap_or(false)
    })
    .await;
    generation.kill(LONG).await.expect("killed with proof");
    assert!(!generation.is_populated().expect("events"));
}

#[tokio::test]
async fn a_populated_generation_is_killed_and_made_fresh() {
    let tree = TestCgroupTree::new("fresh-pop");
    let (instance, generation) = app_generation(&tree, 2).await;
    let mut leftover = start_in(generation.path(), "exec sleep 1000");
    eventually(LONG, "the leftover in its cgroup", || {
        generation.is_populated().unwrap_or(false)
    })
    .await;

    let fresh = instance
        .create_generation(2, &Tier::default())
        .await
        .expect("made fresh");
    assert_eq!(fresh.path(), generation.path());
    assert!(!fresh.is_populated().expect("events"));
    let status = leftover.wait().await.expect("reaped");
    assert_eq!(
        status.signal(),
        Some(Signal::SIGKILL as i32),
        "killed by cgroup.kill"
    );
}

#[tokio::test]
async fn an_empty_leftover_generation_is_recreated() {
    let tree = TestCgroupTree::new("fresh-empty");
    let instance = app(&tree);
    let gen_dir = instance.path().join("gen-4");
    fs::create_dir(&gen_dir).expect("leftover gen-4");
    fs::create_dir(gen_dir.join("nested")).expect("a leftover child cgroup");

    let fresh = instance
        .create_generation(4, &Tier::default())
        .await
        .expect("recreated");
    assert!(fresh.exists());
    assert!(
        !gen_dir.join("nested").exists(),
        "the leftover subtree is gone"
    );
}

#[tokio::test]
async fn listing_reports_generations_populated_state_and_pids() {
    let tree = TestCgroupTree::new("list");
    let manager = tree.manager();
    let instance = manager.instance(&key("prod", "api")).expect("instance");
    let live = instance
        .create_generation(5, &Tier::default())
        .await
        .expect("gen-5");
    instance
        .create_generation(6, &Tier::default())
        .await
        .expect("gen-6");
    fs::create_dir(instance.path().join("not-a-gen")).expect("stray cgroup");
    let child = start_in(live.path(), "exec sleep 1000");
    let pid = child.id().expect("pid");
    eventually(LONG, "the process in gen-5", || {
        live.pids().map(|p| p == vec![pid]).unwrap_or(false)
    })
    .await;

    let listing = manager.list().expect("list");
    assert_eq!(listing.len(), 1);
    let entry = &listing[0];
    assert_eq!(entry.dir_name, "prod.api");
    assert_eq!(entry.others, vec![instance.path().join("not-a-gen")]);
    let summary: Vec<(u64, bool, Vec<u32>)> = entry
        .generations
        .iter()
        .map(|g| (g.generation, g.populated, g.pids.clone()))
        .collect();
    assert_eq!(summary, vec![(5, true, vec![pid]), (6, false, vec![])]);

    let err = live
        .remove()
        .expect_err("a populated cgroup is not removed");
    assert!(matches!(err, CgroupError::NotEmpty { .. }), "{err:?}");
    assert!(manager.list().expect("list").len() == 1);
    assert_eq!(PathBuf::from(manager.root()), tree.path().join("genswap"));
}

#[tokio::test]
async fn remove_subtree_kills_every_nested_process_and_removes_every_directory() {
    let tree = TestCgroupTree::new("subtree");
    let top = tree.path().join("sandbox");
    let nested = top.join("a").join("b");
    fs::create_dir_all(&nested).expect("create nested cgroups");
    let mut shallow = start_in(&top.join("a"), "exec sleep 600");
    let mut deep = start_in(&nested, "exec sleep 600");
    eventually(LONG, "both processes joined", || {
        node_agent::cgroup::processes_in(&top) == 2
    })
    .await;

    let removing = top.clone();
    let found =
        tokio::task::spawn_blocking(move || node_agent::cgroup::remove_subtree(&removing, LONG))
            .await
            .expect("the blocking removal ran")
            .expect("the subtree is removed");
    assert_eq!(found, 2, "both processes were counted");
    assert!(!top.exists(), "every directory is gone, the top one too");
    for child in [&mut shallow, &mut deep] {
        let status = tokio::time::timeout(LONG, child.wait())
            .await
            .expect("the process was reaped in time")
            .expect("wait for the process");
        assert_eq!(status.signal(), Some(Signal::SIGKILL as i32), "killed");
    }
    // Removing what is already gone is not an error.
    assert_eq!(node_agent::cgroup::remove_subtree(&top, LONG).ok(), Some(0));
}
