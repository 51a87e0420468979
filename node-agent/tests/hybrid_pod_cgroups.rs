//! The agent in a pod on a hybrid host (cgroup v1 controllers beside the
//! cgroup v2 tree), on this machine's real v1 hierarchies.
//!
//! The "pod" is a cgroup `…/kubepods/besteffort/pod…/agent` made in every
//! v1 hierarchy the test runs in, under the test's own cgroup there, as the
//! kubelet and runc lay a pod out; the agent is moved into it before its
//! exec, as runc moves a container's first process. When a hostPID
//! container stops, containerd kills every process in its cgroup, and the
//! kubelet what is left in the pod's: here every process found in the
//! pod's cgroups of any hierarchy is SIGKILLed until they are empty.
//!
//! What this cannot show: runc's and the kubelet's own kill paths (the
//! chart's story on the real node, `e2e/tests/chart_node.rs`, runs those),
//! and a v1 hierarchy the host has but does not mount.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "crash_support/mod.rs"]
mod crash_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::path::{Path, PathBuf};

use crash_support::{Manifest, Node, poll, quiet};
use node_agent::cgroup::hybrid::{V1_HOME, v1_memberships};

/// One v1 hierarchy the test runs in, found by where its own pid is.
struct Hierarchy {
    name: String,
    /// The test's own cgroup directory in it.
    own: PathBuf,
    /// The test's own cgroup path from the hierarchy's root.
    own_path: String,
}

/// The v1 hierarchies whose cgroup of this process is visible through a
/// mount here: a mount of that hierarchy (by its super options) whose
/// directory for the path lists this process.
fn hierarchies() -> Vec<Hierarchy> {
    let own_pid = std::process::id().to_string();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").expect("the mount table");
    let mounts: Vec<(PathBuf, Vec<&str>)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            let point = mount.split_whitespace().nth(4)?;
            let mut fs = fs.split_whitespace();
            let options = fs.nth(2)?.split(',').collect();
            (fs_type(line) == Some("cgroup")).then(|| (PathBuf::from(point), options))
        })
        .collect();
    let proc_cgroup = fs::read_to_string("/proc/self/cgroup").expect("own cgroups");
    v1_memberships(&proc_cgroup)
        .into_iter()
        .filter_map(|membership| {
            let own = mounts.iter().find_map(|(point, options)| {
                let of_it = membership
                    .hierarchy
                    .split(',')
                    .all(|controller| options.contains(&controller));
                let dir = point.join(membership.path.trim_start_matches('/'));
                (of_it
                    && fs::read_to_string(dir.join("cgroup.procs"))
                        .is_ok_and(|procs| procs.lines().any(|pid| pid == own_pid)))
                .then_some(dir)
            })?;
            Some(Hierarchy {
                name: membership.hierarchy,
                own,
                own_path: membership.path,
            })
        })
        .collect()
}

fn fs_type(mountinfo_line: &str) -> Option<&str> {
    mountinfo_line
        .split_once(" - ")?
        .1
        .split_whitespace()
        .next()
}

/// The pod's cgroups in every hierarchy, removed on drop after every
/// process left in them is killed.
struct V1Pod {
    hierarchies: Vec<Hierarchy>,
    /// `genswap-test-…`, under the test's own cgroup.
    top: String,
}

const POD: &str = "kubepods/besteffort/pod-genswap-test/agent";

impl V1Pod {
    fn new(tag: &str) -> Option<V1Pod> {
        let hierarchies = hierarchies();
        if hierarchies.is_empty() {
            return None;
        }
        let pod = V1Pod {
            hierarchies,
            top: format!("genswap-test-{tag}-{}", std::process::id()),
        };
        for hierarchy in &pod.hierarchies {
            let mut dir = hierarchy.own.join(&pod.top);
            for component in std::iter::once("").chain(POD.split('/')) {
                dir.push(component);
                make_cgroup(&dir);
            }
        }
        Some(pod)
    }

    /// The pod's cgroup directory in each hierarchy.
    fn dirs(&self) -> Vec<PathBuf> {
        self.hierarchies
            .iter()
            .map(|h| h.own.join(&self.top).join(POD))
            .collect()
    }

    /// The path from the root of `hierarchy` where the agent's children
    /// belong: `genswap` beside `kubepods`.
    fn home_path(&self, hierarchy: &str) -> Option<String> {
        let h = self.hierarchies.iter().find(|h| h.name == hierarchy)?;
        let own = h.own_path.trim_end_matches('/');
        Some(format!("{own}/{}/{V1_HOME}", self.top))
    }

    /// Kills every process in the pod's cgroups, as the runtime and the
    /// kubelet do when the pod goes, until they are empty.
    async fn kill_all(&self) {
        poll("the pod's v1 cgroups to empty", || {
            let pids: Vec<u32> = self.dirs().iter().flat_map(|dir| procs(dir)).collect();
            for pid in &pids {
                if let Ok(pid) = i32::try_from(*pid) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            pids.is_empty()
        })
        .await;
    }
}

impl Drop for V1Pod {
    fn drop(&mut self) {
        for hierarchy in &self.hierarchies {
            let top = hierarchy.own.join(&self.top);
            kill_and_remove(&top);
        }
    }
}

/// A v1 cgroup directory; a cpuset one gets its parent's CPUs and memory
/// nodes, without which it takes no process.
fn make_cgroup(dir: &Path) {
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => panic!("create {}: {e}", dir.display()),
    }
    let parent = dir.parent().expect("a parent");
    for file in ["cpuset.cpus", "cpuset.mems"] {
        if let Ok(value) = fs::read_to_string(parent.join(file)) {
            fs::write(dir.join(file), value.trim()).expect("inherit the cpuset");
        }
    }
}

fn procs(dir: &Path) -> Vec<u32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// SIGKILLs what is left under `dir` (by pid) and removes it bottom-up,
/// retrying while the kernel reaps.
fn kill_and_remove(dir: &Path) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while dir.exists() && std::time::Instant::now() < deadline {
        remove_below(dir);
        if dir.exists() {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

fn remove_below(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_below(&entry.path());
            }
        }
    }
    for pid in procs(dir) {
        if let Ok(pid) = i32::try_from(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    let _ = fs::remove_dir(dir);
}

/// The v1 lines of `/proc/<pid>/cgroup`.
fn v1_cgroups_of(pid: u32) -> Vec<(String, String)> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    v1_memberships(&text)
        .into_iter()
        .map(|m| (m.hierarchy, m.path))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_of_an_agent_in_a_pods_v1_cgroups_leave_them_and_outlive_the_pod() {
    let Some(pod) = V1Pod::new("hybrid") else {
        eprintln!(
            "skipped children_of_an_agent_in_a_pods_v1_cgroups_leave_them: no cgroup v1 hierarchy is mounted here (a pure cgroup v2 host has no v1 cgroups to leave)"
        );
        return;
    };
    // Declared after the pod: dropped first, so its processes are gone by
    // the time the pod's cgroups are removed.
    let node = Node::new("hybrid");
    let v1 = node.build("v1");
    node.write(&Manifest::new("v1", &v1, "overlap"));
    let mut agent = node.start_in_v1_pod(&pod.dirs());
    node.status("the install from the pod", |doc| {
        quiet(doc) && doc.attempt(1).is_some()
    })
    .await;
    assert_eq!(
        agent
            .logged("hybrid host: the agent's children leave its pod's v1 cgroup")
            .len(),
        pod.hierarchies.len(),
        "{}",
        agent.log_text()
    );
    let serving = node.who_serves().await.expect("v1 serves");

    // The instance, its log shim and every other child of the agent: in
    // each hierarchy the pod is in, beside kubepods, not in it.
    let children = node.pids_in_tree();
    assert!(children.contains(&serving.pid), "{children:?}");
    for pid in children {
        for (hierarchy, path) in v1_cgroups_of(pid) {
            if let Some(home) = pod.home_path(&hierarchy) {
                assert_eq!(path, home, "pid {pid} in {hierarchy}");
            }
        }
    }

    // The pod goes: everything in its cgroups is killed, the agent too.
    pod.kill_all().await;
    agent.exited().await;
    assert_eq!(node.who_serves().await, Some(serving.clone()));

    // The next agent, in the pod again, adopts it.
    let mut next = node.start_in_v1_pod(&pod.dirs());
    next.wait_recovered().await;
    node.status("Ready under the next agent", |doc| {
        quiet(doc)
            && doc
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
    })
    .await;
    assert_eq!(node.who_serves().await, Some(serving));
    next.terminate().await;
}
