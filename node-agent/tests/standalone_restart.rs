//! Standalone mode across a restart: the scheduler's revisions and failure
//! book live in the state dir, so a new process continues where the old
//! one stopped, and the intent journal lets go of every outcome the status
//! file holds; a restart with labels the selector no longer matches stops
//! the instance. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{Cause, ConditionType, Outcome};
use standalone_support::{Manifest, StandaloneHost, key, labels};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_revisions_and_the_failure_book() {
    let mut host = StandaloneHost::start_with("restart", false);
    let one = host.build("build-1");
    let hello = key("hello");

    // An install that fails its health check: held down, nothing runs.
    let mut broken = Manifest::new("hello", "build-1", &one);
    broken.args = vec!["--status=500".into()];
    broken.health_timeout_seconds = 2;
    host.write("hello.yaml", &broken.yaml());
    let doc = host.settled_after("hello.yaml", 0).await;
    let failed = doc.last_attempt().expect("the install").clone();
    assert_eq!(
        (failed.cause, failed.outcome),
        (Cause::Install, Outcome::Failed)
    );
    assert_eq!(doc.status.held_down.len(), 1);
    cgroup_guard::eventually(
        swap_host::DEADLINE,
        "the journal to let go of the outcome",
        || {
            host.host
                .engine
                .journal()
                .pending_reports()
                .is_ok_and(|pending| pending.iter().all(|r| r.instance != hello))
        },
    )
    .await;
    assert!(
        host.pids_in_tree().is_empty(),
        "a failed install leaves nothing running"
    );

    host.restart().await;

    // The same build with its knob off and a new retry token: only a
    // restored failure book makes this a retry, and only restored revisions
    // give it the next one.
    let mut fixed = Manifest::new("hello", "build-1", &one);
    fixed.retry = "after-restart".into();
    host.write("hello.yaml", &fixed.yaml());
    let doc = host.settled_after("hello.yaml", failed.sched_rev).await;
    let last = doc.last_attempt().expect("the retry");
    assert_eq!(last.sched_rev, failed.sched_rev + 1, "revisions continue");
    assert_eq!(
        (last.cause, last.outcome),
        (Cause::Retry, Outcome::Done),
        "{last:?}"
    );
    assert!(doc.is_true(ConditionType::Ready));
    assert!(doc.status.held_down.is_empty());
    assert_eq!(
        doc.generation,
        Some(2),
        "the generation number continues too"
    );
    let serving = host.who_serves(&hello).await.expect("build-1 answers");
    assert_eq!(serving.build, "build-1");

    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_labels_the_selector_misses_stops_the_instance() {
    let mut host =
        StandaloneHost::start_labelled("restart-relabel", false, labels(&[("pool", "edge")]));
    let one = host.build("build-1");
    let hello = key("hello");
    let mut manifest = Manifest::new("hello", "build-1", &one);
    manifest.node_selector = labels(&[("pool", "edge")]);
    host.write("hello.yaml", &manifest.yaml());
    host.settled_after("hello.yaml", 0).await;
    let serving = host.who_serves(&hello).await.expect("hello answers");

    host.restart_labelled(labels(&[("pool", "core")])).await;
    swap_host::eventually("the generation's process gone", || {
        !swap_host::alive(serving.pid)
    })
    .await;
    let doc = host
        .status("hello.yaml", "no node selected", |doc| {
            doc.status.nodes.is_empty()
        })
        .await;
    assert!(!doc.is_true(ConditionType::Ready), "{doc:#?}");
    assert_eq!(host.who_serves(&hello).await, None, "nothing answers");

    host.stop().await;
}
