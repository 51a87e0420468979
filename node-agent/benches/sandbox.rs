//! What the sandbox (SPEC 5.16) adds to a spawn: the test app started and
//! run to its exit (`TESTAPP_TRY` with nothing to try) in a fresh cgroup,
//! as `nobody`, with no sandbox (as before it), with the default sandbox
//! (limits, the emptied bounding set, the seccomp filter, the `Protected`
//! filesystem), with it but `filesystem: Host` (the sandbox of the last
//! release), with it but `seccomp: Unconfined`, and with it and
//! `process.root: build` (the test app and the libraries `ldd` names in a
//! tree of their own as `/`), the five taking turns.
//!
//! Prints the spawn (from `spawn()` to its return: the exec done) and the
//! whole run to the exit, median, 99th percentile and largest. It asserts
//! nothing on time.
//!
//! `cargo bench -p node-agent --bench sandbox` (root, cgroup v2).
//! `SPAWNS=n` changes the count per kind.

#[path = "../tests/support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "support/figures.rs"]
mod figures;

use std::time::{Duration, Instant};

use cgroup_guard::TestCgroupTree;
use figures::print_row;
use genswap_crds::{FilesystemProfile, SeccompProfile};
use node_agent::cgroup::Tier;
use node_agent::confine::SandboxSpec;
use node_agent::gate::InstanceKey;
use node_agent::spawn::{Output, SpawnSpec, spawn};

const DEFAULT_SPAWNS: usize = 200;

fn main() {
    figures::run_counted("SPAWNS", DEFAULT_SPAWNS, run);
}

async fn run(spawns: usize) {
    let tree = TestCgroupTree::new("bench-sandbox");
    let instance = tree
        .manager()
        .instance(&InstanceKey::new("bench", "sandbox").expect("a key"))
        .expect("an instance cgroup");
    let app = testapp::binary().expect("the test app is built");
    let run = tempfile::tempdir().expect("a run dir");
    let tree = tempfile::tempdir().expect("a tree");
    let in_tree = tree.path().join("bin/testapp");
    std::fs::create_dir_all(tree.path().join("bin")).expect("its bin");
    std::fs::copy(&app, &in_tree).expect("the test app in the tree");
    testapp::copy_libraries(tree.path(), &app).expect("its libraries");
    let kinds: [(&str, Option<SandboxSpec>); 5] = [
        ("no sandbox", None),
        ("default sandbox", Some(SandboxSpec::default())),
        (
            "sandbox, filesystem Host",
            Some(SandboxSpec {
                filesystem: FilesystemProfile::Host,
                ..SandboxSpec::default()
            }),
        ),
        (
            "sandbox, seccomp Unconfined",
            Some(SandboxSpec {
                seccomp: SeccompProfile::Unconfined,
                ..SandboxSpec::default()
            }),
        ),
        (
            "sandbox, root: build",
            Some(SandboxSpec {
                root: genswap_crds::RootProfile::Build,
                tree: Some(tree.path().to_path_buf()),
                ..SandboxSpec::default()
            }),
        ),
    ];
    let mut spawned: Vec<Vec<Duration>> = vec![Vec::new(); kinds.len()];
    let mut exited: Vec<Vec<Duration>> = vec![Vec::new(); kinds.len()];
    let mut generation = 0;
    for _ in 0..spawns {
        for (i, (_, sandbox)) in kinds.iter().enumerate() {
            generation += 1;
            let cgroup = instance
                .create_generation(generation, &Tier::default())
                .await
                .expect("a generation cgroup");
            let socket = run.path().join(format!("gen-{generation}.sock"));
            let exe = match sandbox.as_ref().and_then(|s| s.tree.as_ref()) {
                Some(_) => &in_tree,
                None => &app,
            };
            let mut spec = SpawnSpec::new(exe, cgroup.clone(), &socket, generation, "b");
            spec.uid = Some(65534);
            spec.gid = Some(65534);
            spec.env = vec![(testapp::knob::TRY.into(), String::new())];
            spec.stdout = Output::Null;
            spec.stderr = Output::Null;
            spec.sandbox = sandbox.clone();
            let began = Instant::now();
            let mut child = spawn(spec).await.expect("spawned");
            spawned[i].push(began.elapsed());
            let status = child.wait().await.expect("its exit");
            exited[i].push(began.elapsed());
            assert!(status.success(), "{status:?}");
            let _ = std::fs::remove_dir(cgroup.path());
            let _ = node_agent::confine::filesystem::remove_private_dir(&socket);
        }
    }
    println!(
        "{spawns} spawns of each kind, taking turns ({})",
        figures::build_and_mount()
    );
    println!(
        "{:<28} {:>10} {:>10} {:>10}",
        "spawn (to the exec)", "p50", "p99", "max"
    );
    for (i, (name, _)) in kinds.iter().enumerate() {
        print_row(name, spawned[i].clone());
    }
    println!(
        "{:<28} {:>10} {:>10} {:>10}",
        "to the exit", "p50", "p99", "max"
    );
    for (i, (name, _)) in kinds.iter().enumerate() {
        print_row(name, exited[i].clone());
    }
}
