//! Names as long as Kubernetes allows, in standalone mode: a 63-byte
//! namespace with a 253-byte name, and a 120-byte name, whose
//! `<namespace>.<name>` fits neither a file name nor a socket path. Each
//! installs, swaps, restarts, logs and is deleted cleanly, every path the
//! agent makes under its cut disk name. The run dir is a `/tmp/gs-*` dir,
//! longer than the default `/run/genswap`. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;

use genswap_crds::{ConditionType, Outcome};
use node_agent::disk_name::{self, DiskName};
use node_agent::gate::InstanceKey;
use standalone_support::{Manifest, StandaloneHost, key};

fn long_manifest(key: &InstanceKey, build_id: &str, build: &testapp::Build) -> String {
    let mut manifest = Manifest::new(key.name(), build_id, build);
    manifest.namespace = Some(key.namespace().to_owned());
    manifest.yaml()
}

/// `node-agent logs NAMESPACE/NAME` over the host's log dir.
fn logs_of(host: &StandaloneHost, key: &InstanceKey) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .arg("logs")
        .arg(format!("{}/{}", key.namespace(), key.name()))
        .arg("--log-dir")
        .arg(&host.host.settings.logs.dir)
        .output()
        .expect("run node-agent logs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_namespace_and_name_install_swap_restart_log_and_are_deleted_cleanly() {
    let host = StandaloneHost::start("names-longest");
    let long = InstanceKey::new(
        format!("ns-{}", "a".repeat(60)),
        format!("{}.{}", "b".repeat(126), "c".repeat(126)),
    )
    .expect("the longest valid key");
    let disk = DiskName::of(&long);
    assert!(disk.is_cut());
    let file = "long.yaml";
    let one = host.build("build-1");
    host.write(file, &long_manifest(&long, "build-1", &one));
    let installed = host
        .status(file, "build-1 to serve", |doc| {
            doc.is_true(ConditionType::Ready)
        })
        .await;
    assert_eq!(installed.error, None, "{installed:?}");
    let first = host.who_serves(&long).await.expect("build-1 answers");

    // Every path the agent made is under the cut name; the run and log dirs
    // say whose they are.
    let run_dir = host.host.engine.layout().instance_dir(&long);
    assert_eq!(
        run_dir.file_name().and_then(|n| n.to_str()),
        Some(disk.as_str())
    );
    assert_eq!(
        fs::read_to_string(run_dir.join(disk_name::RECORD_FILE)).expect("the run dir's record"),
        format!("{}/{}\n", long.namespace(), long.name())
    );
    assert!(host.instance_cgroup(&long).is_dir());
    let journal = host.host.engine.journal().path_of(&long);
    assert!(journal.is_file(), "{}", journal.display());
    let state = host
        .state_dir()
        .join("standalone")
        .join(format!("{disk}.yaml"));
    assert!(state.is_file(), "{}", state.display());
    let log_dir = host.host.settings.logs.dir.join(disk.log_dir_name());
    assert!(log_dir.join("1.log").is_file(), "{}", log_dir.display());
    assert_eq!(disk_name::resolve_log_dir(&log_dir), Some(long.clone()));

    // `node-agent paths` names the socket a front proxy connects to.
    let paths = std::process::Command::new(env!("CARGO_BIN_EXE_node-agent"))
        .arg("paths")
        .arg(format!("{}/{}", long.namespace(), long.name()))
        .arg("--run-dir")
        .arg(&host.host.settings.run_dir)
        .arg("--state-dir")
        .arg(host.state_dir())
        .arg("--log-dir")
        .arg(&host.host.settings.logs.dir)
        .output()
        .expect("run node-agent paths");
    let paths = String::from_utf8_lossy(&paths.stdout);
    let socket = paths
        .lines()
        .find_map(|line| line.strip_prefix("current.sock"))
        .map(str::trim)
        .expect("a current.sock line");
    assert_eq!(
        swap_host::ask(std::path::Path::new(socket)).await,
        Some(first.clone())
    );
    for path in [&journal, &state, &log_dir] {
        assert!(
            paths.contains(&path.display().to_string()),
            "{} not in\n{paths}",
            path.display()
        );
    }

    // A swap.
    let two = host.build("build-2");
    host.write(file, &long_manifest(&long, "build-2", &two));
    let swapped = host
        .status(file, "build-2 to serve", |doc| {
            doc.is_true(ConditionType::Ready)
                && doc.status.nodes.first().and_then(|n| n.generation) == Some(2)
        })
        .await;
    assert_eq!(swapped.error, None, "{swapped:?}");
    let second = host.who_serves(&long).await.expect("build-2 answers");
    assert_eq!(second.build, "build-2");
    assert!(!swap_host::alive(first.pid), "build-1 was retired");

    // A restart, by the supervisor, after a SIGKILL.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(second.pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL generation 2");
    host.status(file, "the restarted generation 3 to serve", |doc| {
        doc.is_true(ConditionType::Ready)
            && doc.status.nodes.first().and_then(|n| n.restarts) == Some(1)
    })
    .await;
    let third = host.who_serves(&long).await.expect("generation 3 answers");
    assert_eq!((third.generation, third.build.as_str()), (3, "build-2"));

    // Its log, by namespace and name.
    let printed = logs_of(&host, &long);
    assert!(
        printed.contains(&format!("[{}]", third.pid)),
        "generation 3's own lines: {printed}"
    );

    // Deleted: nothing of it is left.
    host.remove(file);
    node_agent::standalone::wait_for_no_status(&host.dir, file, swap_host::DEADLINE)
        .await
        .expect("the status file goes once the instance stopped");
    assert_eq!(host.pids_in_tree(), Vec::<u32>::new());
    assert!(!run_dir.exists(), "run dir left: {}", run_dir.display());
    assert!(!host.instance_cgroup(&long).exists(), "cgroup left");
    assert!(!journal.exists(), "journal file left");
    assert!(!state.exists(), "state file left");
    host.stop().await;
}

/// Above about 75 bytes the socket path under the default run dir passed
/// `sun_path`, and the build was blamed for the bind it could not make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_120_byte_name_serves_and_survives_an_agent_restart() {
    let mut host = StandaloneHost::start_with("names-120", false);
    let long = key(&format!("web-{}", "x".repeat(116)));
    assert_eq!(long.name().len(), 120);
    let one = host.build("build-1");
    host.write("web.yaml", &long_manifest(&long, "build-1", &one));
    let doc = host
        .status("web.yaml", "build-1 to serve", |doc| {
            doc.is_true(ConditionType::Ready)
        })
        .await;
    let last = doc.last_attempt().expect("the install");
    assert_eq!(last.outcome, Outcome::Done, "{last:?}");
    let serving = host.who_serves(&long).await.expect("it answers");
    assert!(
        host.current_sock(&long).as_os_str().len() <= disk_name::SOCKET_PATH_MAX,
        "{}",
        host.current_sock(&long).display()
    );

    // A new agent finds it by its cut name and adopts the same process.
    host.restart().await;
    host.status("web.yaml", "Ready after the agent restart", |doc| {
        doc.is_true(ConditionType::Ready)
    })
    .await;
    assert_eq!(host.who_serves(&long).await, Some(serving));
    host.stop().await;
}
