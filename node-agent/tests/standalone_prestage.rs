//! Standalone mode with `rollout.prestage` (its default, SPEC 5.15): a new
//! build is staged into the store before its swap; a build that cannot be
//! staged (its bytes are not the pinned ones) holds the swap back with the
//! reason on the status, runs nothing, and stalls after the deadline; the
//! right build is staged, then swapped in. Real processes, real cgroups.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "standalone_support/mod.rs"]
mod standalone_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{ConditionType, Outcome, StagingState};
use node_agent::standalone::StatusDocument;
use standalone_support::{Manifest, StandaloneHost, key};

fn condition(doc: &StatusDocument, type_: &str) -> (String, String, String) {
    doc.status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

fn prestage(doc: &StatusDocument) -> Option<genswap_crds::PrestageStatus> {
    doc.status.rollout.as_ref()?.prestage.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_is_staged_before_its_swap_and_a_bad_build_waits_with_its_reason() {
    let host = StandaloneHost::start("prestage");
    let web = key("web");
    let one = host.build("build-1");
    let two = host.build("build-2");
    host.write("web.yaml", &Manifest::new("web", "build-1", &one).yaml());
    host.status("web.yaml", "build-1 to serve", |doc| {
        doc.is_true(ConditionType::Ready)
    })
    .await;
    let before = host.who_serves(&web).await.expect("build-1 serves");

    // build-2 pinned to build-1's digest: its bytes are not the pinned ones.
    let mut wrong = Manifest::new("web", "build-2", &two);
    wrong.sha256 = one.sha256.clone();
    wrong.rollout = Some("{prestageDeadlineSeconds: 2}".into());
    host.write("web.yaml", &wrong.yaml());
    let doc = host
        .status("web.yaml", "the stage to be refused", |doc| {
            prestage(doc).is_some_and(|p| {
                p.nodes
                    .first()
                    .is_some_and(|n| n.state == StagingState::Failed)
            })
        })
        .await;
    let (_, reason, message) = condition(&doc, "Reconciling");
    assert_eq!(reason, "Prestaging", "{message}");
    assert!(message.contains("cannot stage"), "{message}");
    let record = prestage(&doc).expect("the prestage record");
    let why = record.nodes[0].reason.clone().unwrap_or_default();
    assert!(why.contains("sha256"), "the reason names the digest: {why}");
    let ask = doc
        .attempts
        .iter()
        .find(|a| a.stage_only)
        .expect("the ask to stage is listed");
    assert_eq!(ask.status.outcome, Some(Outcome::Failed));
    assert_eq!(ask.status.executed, Some(false));
    assert!(
        doc.attempts
            .iter()
            .all(|a| a.stage_only || a.build == "build-1"),
        "no swap to build-2 was issued: {:?}",
        doc.attempts
    );
    assert_eq!(
        host.who_serves(&web).await,
        Some(before),
        "build-1 keeps serving"
    );

    let doc = host
        .status("web.yaml", "Stalled=True PrestageDeadlineExceeded", |doc| {
            condition(doc, "Stalled").1 == "PrestageDeadlineExceeded"
        })
        .await;
    assert_eq!(condition(&doc, "Stalled").0, "True");

    // The right digest: staged, then swapped in.
    host.write("web.yaml", &Manifest::new("web", "build-2", &two).yaml());
    let doc = host
        .status("web.yaml", "build-2 to serve", |doc| {
            doc.is_true(ConditionType::Ready)
                && doc.status.nodes.first().and_then(|n| n.build.as_deref()) == Some("build-2")
        })
        .await;
    let record = prestage(&doc).expect("the prestage record");
    assert_eq!(
        (record.build.as_str(), record.staged, record.needed),
        ("build-2", 1, 1)
    );
    assert!(record.done_at.is_some(), "{record:?}");
    assert_eq!(record.fetched_bytes, 0, "a path build is read, not fetched");
    assert_eq!(
        host.who_serves(&web).await.map(|i| i.build),
        Some("build-2".into())
    );
    host.stop().await;
}
