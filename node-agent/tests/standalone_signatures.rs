//! Standalone mode on a node that runs only signed builds
//! (`--trust-keys`, `--require-signatures`, SPEC 5.15): an unsigned build
//! and one whose `cosign sign-blob` signature was made by another key are
//! `failed` with `executed: false`, held down, with nothing of them run;
//! the build signed by the named key installs and serves. Signatures and
//! keys from openssl, as cosign makes them. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::fs;

use genswap_crds::{ConditionType, Outcome};
use standalone_support::{Manifest, StandaloneHost, key};
use test_cluster::signing::KeyPair;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_build_signed_by_the_named_key_runs() {
    if !test_cluster::registry::tools_installed() {
        return;
    }
    let keys = tempfile::tempdir().expect("key dir");
    let trust = keys.path().join("trust");
    let release = KeyPair::generate(&trust, "release");
    let other = KeyPair::generate(&keys.path().join("other"), "other");
    let host = StandaloneHost::start_trusting(
        "signatures",
        genswap_store::TrustPolicy {
            keys: Some(trust.clone()),
            require_signatures: true,
        },
    );
    let hello = key("hello");
    let one = host.build("build-1");
    let bytes = fs::read(&one.path).expect("the build's bytes");

    // Unsigned: refused before anything is fetched.
    host.write(
        "hello.yaml",
        &Manifest::new("hello", "build-1", &one).yaml(),
    );
    let doc = host
        .status("hello.yaml", "the unsigned install to end", |doc| {
            doc.last_attempt().is_some()
        })
        .await;
    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!(last.outcome, Outcome::Failed, "{last:?}");
    assert!(!last.executed, "nothing of the build ran: {last:?}");
    assert!(
        last.reason.contains("requires signatures"),
        "the reason says why: {}",
        last.reason
    );
    assert!(
        host.generation_cgroups(&hello).is_empty(),
        "nothing started"
    );

    // Signed by a key the node does not trust.
    let mut manifest = Manifest::new("hello", "build-1", &one);
    manifest.signed = Some(("release".into(), Some(other.sign(&bytes))));
    manifest.retry = "1".into();
    host.write("hello.yaml", &manifest.yaml());
    let doc = host.settled_after("hello.yaml", last.sched_rev).await;
    let last = doc.last_attempt().expect("a last attempt");
    assert_eq!(last.outcome, Outcome::Failed, "{last:?}");
    assert!(!last.executed, "{last:?}");
    assert!(
        last.reason.contains("does not verify with key \"release\""),
        "{}",
        last.reason
    );
    assert!(!doc.is_true(ConditionType::Ready));
    assert!(host.pids_in_tree().is_empty(), "nothing runs");

    // Signed by the named key: installs and serves.
    manifest.signed = Some(("release".into(), Some(release.sign(&bytes))));
    manifest.retry = "2".into();
    host.write("hello.yaml", &manifest.yaml());
    let doc = host.settled_after("hello.yaml", last.sched_rev).await;
    let install = doc.last_attempt().expect("the install");
    assert_eq!(install.outcome, Outcome::Done, "{install:?}");
    assert!(doc.is_true(ConditionType::Ready));
    assert_eq!(
        host.who_serves(&hello).await.expect("serves").build,
        "build-1"
    );

    host.stop().await;
}
