//! The agent in a pod's namespaces (SPEC 5.9). A DaemonSet pod's container
//! has a cgroup namespace whose root is the pod's cgroup and a mount
//! namespace of its own; with hostPID it still sees the host's PID 1. Here
//! that pod is `unshare --mount --cgroup --fork` run inside a cgroup of the
//! test's subtree, with cgroup2 mounted again to show only the pod.
//!
//! Joining PID 1's namespaces, the agent's instances live in the host's
//! tree, outside the pod: killing every process of the pod leaves them
//! serving, and an agent in a new pod adopts them. Without joining it
//! refuses to start. The agent must be able to inspect PID 1's namespaces,
//! which this machine's sandbox forbids (`/proc/1/ns/*` cannot be read), so
//! the tests run in the VM (`tests/tests/vm_cgroup_v2.rs`, `GENSWAP_IN_VM=1`);
//! elsewhere each says in one line that it skipped.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "crash_support/mod.rs"]
mod crash_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;
use std::path::Path;

use crash_support::{Manifest, Node, poll, quiet};
use genswap_crds::Outcome;

/// Whether PID 1's namespaces can be inspected here; says why not.
fn pid_1_visible(test: &str) -> bool {
    let visible = ["/proc/1/ns/mnt", "/proc/1/ns/cgroup"]
        .iter()
        .all(|path| fs::metadata(path).is_ok());
    if visible {
        return true;
    }
    assert!(
        std::env::var_os("GENSWAP_IN_VM").is_none(),
        "the VM's PID 1 namespaces cannot be inspected"
    );
    eprintln!(
        "skipped {test}: /proc/1/ns cannot be inspected here, so no agent can join PID 1's namespaces (the VM runner runs this: tests/tests/vm_cgroup_v2.rs)"
    );
    false
}

/// The cgroup a process is in, as the test (in PID 1's namespace) sees it.
fn cgroup_of(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .unwrap_or_default()
        .to_owned()
}

/// The mount-relative path of a cgroup directory.
fn relative(node: &Node, dir: &Path) -> String {
    format!(
        "/{}",
        dir.strip_prefix(node.cgroup_mount())
            .expect("under the mount")
            .display()
    )
}

/// `cgroup.kill` on the pod, as the kubelet does when the pod goes, and
/// the wait for it to empty.
async fn kill_pod(pod: &Path) {
    fs::write(pod.join("cgroup.kill"), "1").expect("kill the pod");
    poll("the pod's cgroup to empty", || {
        fs::read_to_string(pod.join("cgroup.events")).is_ok_and(|e| e.contains("populated 0"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_in_a_pod_places_instances_outside_it_and_they_outlive_the_pod() {
    if !pid_1_visible("an_agent_in_a_pod_places_instances_outside_it") {
        return;
    }
    let node = Node::new("vm-pod");
    let mount = node.cgroup_mount().to_path_buf();
    let first_pod = node.tree_path().join("pod-1");
    let v1 = node.build("v1");
    let v2 = node.build("v2");
    node.write(&Manifest::new("v1", &v1, "overlap"));
    let agent = node.start_in_pod(&first_pod, &mount, true);
    node.status("the install in the pod", |doc| {
        quiet(doc) && doc.attempt(1).is_some()
    })
    .await;
    assert!(
        agent.log_text().contains("joined the host"),
        "{}",
        agent.log_text()
    );

    // An overlap, also from inside the pod.
    node.write(&Manifest::new("v2", &v2, "overlap"));
    let doc = node
        .status("the release in the pod", |doc| {
            quiet(doc) && doc.attempt(2).is_some()
        })
        .await;
    assert_eq!(
        doc.attempt(2).and_then(|a| a.status.outcome),
        Some(Outcome::Done),
        "{doc:?}"
    );
    let serving = node.who_serves().await.expect("v2 serves");
    assert_eq!(serving.build, "v2");
    let expected = relative(&node, &node.instance_cgroup().join("gen-2"));
    assert_eq!(cgroup_of(serving.pid), expected, "in the host's tree");
    let pod = relative(&node, &first_pod);
    assert!(!cgroup_of(serving.pid).starts_with(&pod));

    // The pod goes, as the kubelet takes it down: every process in it is
    // killed. The instance does not notice.
    kill_pod(&first_pod).await;
    assert_eq!(node.who_serves().await, Some(serving.clone()));

    // A new agent in a new pod adopts it.
    let second_pod = node.tree_path().join("pod-2");
    let agent = node.start_in_pod(&second_pod, &mount, true);
    agent.wait_recovered().await;
    let adopted = agent.logged("crash recovery done");
    assert_eq!(
        adopted
            .first()
            .and_then(|line| line["fields"]["serving"].as_u64()),
        Some(1),
        "{adopted:?}"
    );
    node.status("Ready under the new agent", |doc| {
        quiet(doc)
            && doc
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
    })
    .await;
    assert_eq!(node.who_serves().await, Some(serving));
    kill_pod(&second_pod).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_in_a_pod_that_does_not_join_the_host_refuses_to_start() {
    if !pid_1_visible("an_agent_in_a_pod_that_does_not_join_the_host_refuses") {
        return;
    }
    let node = Node::new("vm-pod-nojoin");
    let v1 = node.build("v1");
    node.write(&Manifest::new("v1", &v1, "overlap"));
    let pod = node.tree_path().join("pod");
    let mut agent = node.start_in_pod(&pod, node.cgroup_mount(), false);
    let status = agent.exited().await;
    assert_eq!(status.code(), Some(1), "{}", agent.log_text());
    let log = agent.log_text();
    assert!(
        log.contains("cgroup namespace is not the host's")
            && log.contains("--join-host-namespaces"),
        "{log}"
    );
    assert!(
        !node.cgroup_root().exists(),
        "no cgroup was made in the host's tree"
    );
    let made: Vec<_> = fs::read_dir(&pod)
        .expect("the pod's cgroup")
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name())
        .collect();
    assert!(made.is_empty(), "nothing was made inside the pod: {made:?}");
}
