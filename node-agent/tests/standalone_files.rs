//! Standalone mode and the manifest directory: a file that does not
//! validate gets a status that says why and disturbs nothing else, a second
//! file naming the same instance is refused, a deleted file stops its
//! instance and leaves nothing behind, and a file whose selector leaves
//! this node stops its instance until it selects the node again. Real
//! processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_core::scheduler;
use genswap_crds::ConditionType;
use node_agent::standalone::status::reasons;
use standalone_support::{Manifest, NODE, StandaloneHost, key, labels};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_file_gets_the_reason_and_disturbs_nothing_else() {
    let host = StandaloneHost::start("invalid");
    let one = host.build("build-1");
    let hello = key("hello");
    let good = Manifest::new("hello", "build-1", &one);
    host.write("hello.yaml", &good.yaml());
    host.settled_after("hello.yaml", 0).await;
    let serving = host.who_serves(&hello).await.expect("build-1 answers");

    // An unknown field in another file.
    let bogus = Manifest::new("other", "build-1", &one)
        .yaml()
        .replace("  mode: overlap", "  mode: overlap\n  bogus: 1");
    host.write("other.yaml", &bogus);
    let doc = host
        .status("other.yaml", "the refusal of other.yaml", |doc| {
            doc.is_true(ConditionType::Stalled)
        })
        .await;
    let stalled = doc.condition(ConditionType::Stalled).expect("Stalled");
    assert_eq!(stalled.reason, reasons::INVALID_MANIFEST);
    assert!(
        stalled.message.contains("spec.bogus"),
        "{}",
        stalled.message
    );
    assert!(!doc.is_true(ConditionType::Ready));
    assert!(
        doc.error
            .as_deref()
            .is_some_and(|e| e.contains("spec.bogus"))
    );
    assert!(doc.attempts.is_empty(), "a refused file runs nothing");

    // A broken edit of the file in force: refused, the last valid spec stays.
    let broken = good.yaml().replace(&one.sha256, "not-a-digest");
    host.write("hello.yaml", &broken);
    let doc = host
        .status("hello.yaml", "the refusal of the edit", |doc| {
            doc.error.is_some()
        })
        .await;
    let stalled = doc.condition(ConditionType::Stalled).expect("Stalled");
    assert_eq!(stalled.reason, reasons::INVALID_MANIFEST);
    assert!(stalled.message.contains("sha256"), "{}", stalled.message);
    assert!(
        doc.is_true(ConditionType::Ready),
        "the instance still serves its spec"
    );
    assert_eq!(
        doc.generation,
        Some(1),
        "a refused edit is not a new generation"
    );
    assert_eq!(
        host.who_serves(&hello).await,
        Some(serving.clone()),
        "the same process still serves"
    );

    // Fixing it clears the refusal without touching the instance.
    host.write("hello.yaml", &good.yaml());
    let doc = host
        .status("hello.yaml", "the refusal to clear", |doc| {
            doc.error.is_none()
        })
        .await;
    assert!(!doc.is_true(ConditionType::Stalled));
    assert_eq!(doc.generation, Some(1));
    assert_eq!(host.who_serves(&hello).await, Some(serving));

    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_file_naming_the_same_instance_is_refused() {
    let host = StandaloneHost::start("duplicate");
    let one = host.build("build-1");
    let two = host.build("build-2");
    let hello = key("hello");
    host.write("a.yaml", &Manifest::new("hello", "build-1", &one).yaml());
    host.settled_after("a.yaml", 0).await;

    host.write("b.yaml", &Manifest::new("hello", "build-2", &two).yaml());
    let doc = host
        .status("b.yaml", "the refusal of b.yaml", |doc| {
            doc.is_true(ConditionType::Stalled)
        })
        .await;
    let stalled = doc.condition(ConditionType::Stalled).expect("Stalled");
    assert_eq!(stalled.reason, reasons::DUPLICATE_NAME);
    assert!(
        stalled.message.contains("a.yaml"),
        "names the owner: {}",
        stalled.message
    );
    assert_eq!(doc.name.as_deref(), Some("hello"));
    let serving = host.who_serves(&hello).await.expect("build-1 answers");
    assert_eq!(serving.build, "build-1", "the owner's build serves");

    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_file_stops_its_generations_and_leaves_nothing() {
    let host = StandaloneHost::start("deleted");
    let one = host.build("build-1");
    let hello = key("hello");
    let keep = key("keep");
    host.write(
        "hello.yaml",
        &Manifest::new("hello", "build-1", &one).yaml(),
    );
    host.write("keep.yaml", &Manifest::new("keep", "build-1", &one).yaml());
    host.settled_after("hello.yaml", 0).await;
    host.settled_after("keep.yaml", 0).await;
    let serving = host.who_serves(&hello).await.expect("hello answers");
    let kept = host.who_serves(&keep).await.expect("keep answers");

    host.remove("hello.yaml");
    node_agent::standalone::wait_for_no_status(&host.dir, "hello.yaml", swap_host::DEADLINE)
        .await
        .expect("the status file goes once the instance stopped");

    assert!(
        !swap_host::alive(serving.pid),
        "the generation's process is gone"
    );
    assert!(
        !host.instance_cgroup(&hello).exists(),
        "its cgroup is removed"
    );
    assert!(
        !host.current_sock(&hello).exists(),
        "current.sock no longer names anything"
    );
    assert!(
        !host.host.engine.layout().instance_dir(&hello).exists(),
        "its run dir is removed"
    );
    assert!(
        !host
            .state_dir()
            .join("standalone")
            .join("default.hello.yaml")
            .exists(),
        "its standalone state is removed"
    );
    assert!(
        !host.host.engine.journal().path_of(&hello).exists(),
        "its journal file is removed"
    );
    assert_eq!(
        host.who_serves(&keep).await,
        Some(kept),
        "the other instance is undisturbed"
    );

    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_deleted_while_its_attempt_runs_cancels_it_and_leaves_nothing() {
    let host = StandaloneHost::start("midway");
    let one = host.build("build-1");
    let hello = key("hello");
    // The process starts, then sleeps before binding: the attempt sits in
    // its health step.
    let mut slow = Manifest::new("hello", "build-1", &one);
    slow.args = vec!["--boot-delay-ms=30000".into()];
    slow.health_timeout_seconds = 60;
    host.write("hello.yaml", &slow.yaml());
    host.status("hello.yaml", "the install to be running", |doc| {
        doc.attempts
            .iter()
            .any(|a| a.status.started_at.is_some() && a.status.outcome.is_none())
    })
    .await;
    cgroup_guard::eventually(swap_host::DEADLINE, "the build's process to start", || {
        !host.pids_in_tree().is_empty()
    })
    .await;

    host.remove("hello.yaml");
    node_agent::standalone::wait_for_no_status(&host.dir, "hello.yaml", swap_host::DEADLINE)
        .await
        .expect("the status file goes once the instance stopped");

    assert_eq!(
        host.pids_in_tree(),
        Vec::<u32>::new(),
        "the process is gone"
    );
    assert!(
        !host.instance_cgroup(&hello).exists(),
        "its cgroup is removed"
    );
    assert!(!host.current_sock(&hello).exists());

    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selector_that_leaves_this_node_stops_the_instance_until_it_matches_again() {
    let host = StandaloneHost::start("unselected");
    let one = host.build("build-1");
    let hello = key("hello");
    let mut manifest = Manifest::new("hello", "build-1", &one);
    manifest.node_selector = hostname(NODE);
    host.write("hello.yaml", &manifest.yaml());
    host.settled_after("hello.yaml", 0).await;
    let serving = host.who_serves(&hello).await.expect("hello answers");

    manifest.node_selector = hostname("elsewhere");
    host.write("hello.yaml", &manifest.yaml());
    let status = host
        .status(
            "hello.yaml",
            "the instance stopped, no node selected",
            |doc| {
                doc.condition(ConditionType::Ready)
                    .is_some_and(|ready| ready.reason == scheduler::reasons::NO_MATCHING_NODES)
                    && doc.attempts.is_empty()
            },
        )
        .await;
    assert!(status.status.nodes.is_empty(), "{status:#?}");
    // The status says what is wanted at once; the stop takes its drain.
    swap_host::eventually("the generation's process gone", || {
        !swap_host::alive(serving.pid)
    })
    .await;
    swap_host::eventually("no generation cgroup left", || {
        host.generation_cgroups(&hello).is_empty()
    })
    .await;
    assert_eq!(host.who_serves(&hello).await, None, "nothing answers");

    // Selecting the node again installs the instance afresh.
    manifest.node_selector = hostname(NODE);
    host.write("hello.yaml", &manifest.yaml());
    host.settled_after("hello.yaml", 0).await;
    let again = host.who_serves(&hello).await.expect("hello answers again");
    assert_ne!(again.pid, serving.pid, "a new process serves");

    host.stop().await;
}

/// A selector on `kubernetes.io/hostname`, the one label a standalone node
/// always has.
fn hostname(name: &str) -> std::collections::BTreeMap<String, String> {
    labels(&[("kubernetes.io/hostname", name)])
}
