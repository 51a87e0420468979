//! Standalone mode end to end: a manifest written into the directory is
//! installed and served, and a new build rolls in by overlap without one
//! request through `current.sock` failing. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{Cause, ConditionType, Mode, Outcome};
use standalone_support::{Client, Manifest, StandaloneHost, key};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_is_installed_and_a_new_build_overlaps_without_failing_a_request() {
    let host = StandaloneHost::start("flow");
    let one = host.build("build-1");
    let two = host.build("build-2");
    let hello = key("hello");

    host.write(
        "hello.yaml",
        &Manifest::new("hello", "build-1", &one).yaml(),
    );
    let doc = host
        .status("hello.yaml", "build-1 to serve (Ready)", |doc| {
            doc.is_true(ConditionType::Ready)
        })
        .await;
    assert_eq!(doc.generation, Some(1));
    assert_eq!(doc.status.observed_generation, Some(1));
    assert_eq!(doc.status.ready.as_deref(), Some("1/1"));
    let node = &doc.status.nodes[0];
    assert_eq!(node.name, standalone_support::NODE);
    assert_eq!(node.build.as_deref(), Some("build-1"));
    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!((last.cause, last.outcome), (Cause::Install, Outcome::Done));
    let install = doc.attempt(last.sched_rev).expect("the install attempt");
    assert_eq!(
        install.name,
        format!("hello-{}-{}", standalone_support::NODE, last.sched_rev)
    );
    assert_eq!(install.status.executed, Some(true));
    let serving = host.who_serves(&hello).await.expect("build-1 answers");
    assert_eq!(serving.build, "build-1");
    let first_generation = serving.generation;

    let client = Client::start(host.current_sock(&hello));
    host.write(
        "hello.yaml",
        &Manifest::new("hello", "build-2", &two).yaml(),
    );
    let doc = host.settled_after("hello.yaml", last.sched_rev).await;
    let (sent, failed) = client.finish().await;

    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!(
        (last.cause, last.mode, last.outcome),
        (Cause::Release, Mode::Overlap, Outcome::Done),
        "{last:?}"
    );
    assert!(
        last.drain_ms.is_some(),
        "the retired generation's drain is reported"
    );
    assert_eq!(doc.generation, Some(2), "a spec change is a new generation");
    assert_eq!(doc.status.observed_generation, Some(2));
    assert!(doc.is_true(ConditionType::Ready));
    assert_eq!(doc.status.good_build.as_deref(), Some("build-2"));
    let attempt = doc.attempt(last.sched_rev).expect("the release attempt");
    assert_eq!(attempt.status.effective_mode, Some(Mode::Overlap));
    let kept: Vec<&str> = doc.attempts.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(
        kept,
        [attempt.name.as_str()],
        "at rest the node keeps one attempt, the one carrying its record"
    );
    assert!(
        !attempt.status.steps.is_empty(),
        "step timings are reported"
    );

    assert!(sent > 0, "the client sent requests during the overlap");
    assert_eq!(
        failed, 0,
        "{failed} of {sent} requests failed during the overlap"
    );
    let serving = host.who_serves(&hello).await.expect("build-2 answers");
    assert_eq!(serving.build, "build-2");
    assert!(serving.generation > first_generation);
    assert_eq!(
        host.generation_cgroups(&hello),
        vec![format!("gen-{}", serving.generation)],
        "only the serving generation's cgroup is left"
    );

    host.stop().await;
}
