//! Standalone mode when a build is wrong: a digest that does not match is
//! refused before anything runs and held down (the bytes are not the
//! build's), a build that fails its health check is held down while the
//! incumbent keeps serving, and a changed `spec.retry`
//! re-arms one more attempt of it. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{Cause, ConditionType, Outcome};
use standalone_support::{Manifest, StandaloneHost, key};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_digest_fails_the_build_without_running_anything() {
    let host = StandaloneHost::start("digest");
    let one = host.build("build-1");
    let other = host.build("build-other");
    let hello = key("hello");

    let mut manifest = Manifest::new("hello", "build-1", &one);
    manifest.sha256 = other.sha256.clone();
    host.write("hello.yaml", &manifest.yaml());
    let doc = host
        .status("hello.yaml", "the install to end", |doc| {
            doc.last_attempt().is_some()
        })
        .await;

    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!(last.outcome, Outcome::Failed, "{last:?}");
    assert!(!last.executed, "nothing of the build ran: {last:?}");
    assert!(
        last.reason.contains("sha256") || last.reason.contains("digest"),
        "the reason names the digest: {}",
        last.reason
    );
    let attempt = doc.attempt(last.sched_rev).expect("the attempt");
    assert_eq!(attempt.status.executed, Some(false));
    assert!(!doc.is_true(ConditionType::Ready));
    assert_eq!(
        doc.status
            .held_down
            .iter()
            .map(|h| h.build.as_str())
            .collect::<Vec<_>>(),
        vec!["build-1"],
        "bytes that are not the pinned ones are the build's fault: held down"
    );
    assert!(
        host.generation_cgroups(&hello).is_empty(),
        "no generation was made"
    );
    assert!(!host.current_sock(&hello).exists(), "nothing serves");
    assert!(host.pids_in_tree().is_empty(), "nothing runs");

    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_build_is_held_down_until_a_retry_rearms_it() {
    let host = StandaloneHost::start("held");
    let one = host.build("build-1");
    let two = host.build("build-2");
    let hello = key("hello");

    host.write(
        "hello.yaml",
        &Manifest::new("hello", "build-1", &one).yaml(),
    );
    let doc = host.settled_after("hello.yaml", 0).await;
    let installed = doc.last_attempt().expect("the install").sched_rev;
    let incumbent = host.who_serves(&hello).await.expect("build-1 answers");

    // build-2 answers 500 to everything, its health check included.
    let mut broken = Manifest::new("hello", "build-2", &two);
    broken.args = vec!["--status=500".into()];
    broken.health_timeout_seconds = 2;
    host.write("hello.yaml", &broken.yaml());
    let doc = host.settled_after("hello.yaml", installed).await;

    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!(
        (last.cause, last.outcome),
        (Cause::Release, Outcome::Failed),
        "{last:?}"
    );
    assert!(last.executed);
    assert!(
        doc.is_true(ConditionType::Stalled),
        "a held-down build needs a human"
    );
    let stalled = doc.condition(ConditionType::Stalled).expect("Stalled");
    assert_eq!(stalled.reason, "BuildFailed");
    assert!(
        stalled.message.contains("spec.retry"),
        "{}",
        stalled.message
    );
    assert_eq!(doc.status.held_down.len(), 1, "{:?}", doc.status.held_down);
    assert_eq!(doc.status.held_down[0].build, "build-2");
    assert!(!doc.status.held_down[0].retry_armed);
    assert_eq!(
        host.who_serves(&hello).await,
        Some(incumbent.clone()),
        "the incumbent keeps serving"
    );
    let failed_rev = last.sched_rev;

    // A changed retry token re-arms one attempt; the knob is off this time,
    // so the re-armed attempt passes.
    let mut fixed = Manifest::new("hello", "build-2", &two);
    fixed.retry = "1".into();
    host.write("hello.yaml", &fixed.yaml());
    let doc = host.settled_after("hello.yaml", failed_rev).await;

    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!(
        (last.cause, last.outcome),
        (Cause::Retry, Outcome::Done),
        "{last:?}"
    );
    assert!(doc.is_true(ConditionType::Ready));
    assert!(!doc.is_true(ConditionType::Stalled));
    assert!(
        doc.status.held_down.is_empty(),
        "{:?}",
        doc.status.held_down
    );
    let serving = host.who_serves(&hello).await.expect("build-2 answers");
    assert_eq!(serving.build, "build-2");

    host.stop().await;
}
