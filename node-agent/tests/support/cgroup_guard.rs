//! A unique cgroup v2 subtree per test, torn down on drop even after a
//! panic: `cgroup.kill` on the whole subtree, wait for `populated 0`, then
//! rmdir bottom-up.
//!
//! Include it with `#[path = "support/cgroup_guard.rs"] mod cgroup_guard;`.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use node_agent::cgroup::{CgroupManager, discover_mount, remove_subtree};

/// How long teardown waits for a killed subtree to empty.
const TEARDOWN_WAIT: Duration = Duration::from_secs(20);

/// `<mount>/genswap-test-<pid>-<tag>-<nonce>`, removed on drop.
pub struct TestCgroupTree {
    path: PathBuf,
    mount: PathBuf,
}

/// The controllers genswap writes limits for.
pub const LIMIT_CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

impl TestCgroupTree {
    /// Creates a fresh subtree directly under the cgroup v2 mount, passing
    /// every limit controller offered there down to its children.
    pub fn new(tag: &str) -> TestCgroupTree {
        TestCgroupTree::delegating(tag, &LIMIT_CONTROLLERS)
    }

    /// A fresh subtree that enables those of `controllers` the mount offers
    /// here in its own `cgroup.subtree_control`, as a delegating parent
    /// (systemd's `Delegate=yes`) does: the agent's root below it can use
    /// them, and nothing else. Where none is offered (a hybrid host) it
    /// writes nothing.
    pub fn delegating(tag: &str, controllers: &[&str]) -> TestCgroupTree {
        let tree = TestCgroupTree::bare(tag);
        let offered = fs::read_to_string(tree.path.join("cgroup.controllers")).unwrap_or_default();
        let enable: Vec<String> = offered
            .split_whitespace()
            .filter(|c| controllers.contains(c))
            .map(|c| format!("+{c}"))
            .collect();
        if !enable.is_empty() {
            fs::write(tree.path.join("cgroup.subtree_control"), enable.join(" "))
                .expect("delegate the limit controllers to the test subtree");
        }
        tree
    }

    fn bare(tag: &str) -> TestCgroupTree {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mount = discover_mount().expect("this host has a writable cgroup v2 mount");
        let nonce = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .subsec_nanos();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = mount.join(format!(
            "genswap-test-{}-{tag}-{nonce:x}-{n}",
            std::process::id()
        ));
        fs::create_dir(&path).expect("create the test cgroup subtree");
        TestCgroupTree { path, mount }
    }

    /// The subtree's directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cgroup v2 mount it lies in.
    pub fn mount(&self) -> &Path {
        &self.mount
    }

    /// A manager rooted at `<subtree>/genswap`.
    pub fn manager(&self) -> CgroupManager {
        CgroupManager::open(self.path.join("genswap")).expect("a manager over the test subtree")
    }
}

impl Drop for TestCgroupTree {
    fn drop(&mut self) {
        if let Err(error) = teardown(&self.path) {
            let message = format!(
                "test cgroup {} not cleaned up: {error}",
                self.path.display()
            );
            // A leak fails the test that made it; during a panic, say so.
            if std::thread::panicking() {
                eprintln!("{message}");
            } else {
                panic!("{message}");
            }
        }
    }
}

/// Kills everything under `path`, waits until it is empty, removes it.
pub fn teardown(path: &Path) -> Result<(), String> {
    remove_subtree(path, TEARDOWN_WAIT)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Starts `/bin/sh -c script` already inside the cgroup at `dir` (the shell
/// joins it, then execs the script). Independent of the crate's spawn so
/// cgroup tests need nothing else. Killed by pid if dropped alive.
pub fn start_in(dir: &Path, script: &str) -> tokio::process::Child {
    tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"echo $$ > "$1/cgroup.procs" && exec /bin/sh -c "$2""#)
        .arg("sh")
        .arg(dir)
        .arg(script)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start a shell")
}

/// Polls `condition` until it holds, failing the test after `timeout`.
pub async fn eventually(timeout: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The instances' processes under `dir`, sorted: the agent's own cgroups
/// are not searched (the log shims', each outliving its generation by the
/// moment it takes to read the end of its pipes, tested by `logs_shims`;
/// the listener keepers', tested by the listener tests).
pub fn instance_pids(dir: &Path) -> Vec<u32> {
    fn collect(dir: &Path, pids: &mut Vec<u32>) {
        if let Ok(text) = fs::read_to_string(dir.join("cgroup.procs")) {
            pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.filter_map(Result::ok) {
                if node_agent::cgroup::is_agent_cgroup(&entry.file_name()) {
                    continue;
                }
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    collect(&entry.path(), pids);
                }
            }
        }
    }
    let mut pids = Vec::new();
    collect(dir, &mut pids);
    pids.sort_unstable();
    pids
}
