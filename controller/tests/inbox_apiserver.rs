//! The node inboxes on a real kube-apiserver (`../shared/kube`, started by
//! test-cluster; the test says in one line that it skipped where there is
//! none): created, patched by the difference, deleted once empty, repaired
//! by a new leader from what it lists, a replaced finished attempt left
//! listed until the node's next one, and, for a controller scoped to a
//! namespace, its own entries only.
//!
//! The attempt watch is stood in for by the events it would deliver
//! (`InboxIndex::observe`); the controller's real watch feeding it runs in
//! e2e/tests/cluster.rs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use genswap_controller::inbox::{InboxIndex, Scope, keep_inboxes};
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_core::scheduler::inbox_name;
use genswap_crds::{Outcome, SwapAttempt, SwapAttemptStatus};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::DeserializeGuard;
use kube::runtime::watcher::Event;
use kube::{Client, ResourceExt};
use serde_json::json;
use test_cluster::{ControlPlane, OwnNamespace};

const DEADLINE: Duration = Duration::from_secs(30);

fn attempt(namespace: &str, name: &str, node: &str, uid: &str) -> DeserializeGuard<SwapAttempt> {
    let mut attempt: SwapAttempt =
        serde_json::from_value(test_cluster::objects::swap_attempt(name, node, 1))
            .expect("a SwapAttempt");
    attempt.metadata.namespace = Some(namespace.into());
    attempt.metadata.uid = Some(uid.into());
    DeserializeGuard(Ok(attempt))
}

/// The keeper as a task, aborted when dropped.
struct Keeper(tokio::task::JoinHandle<()>);

impl Keeper {
    fn start(client: &Client, namespace: &str, scope: Scope, index: &InboxIndex) -> Self {
        let leadership = Leadership::follower(Arc::new(Metrics::new()));
        leadership.set(true);
        Self(tokio::spawn(keep_inboxes(
            client.clone(),
            namespace.to_string(),
            scope,
            index.clone(),
            leadership,
        )))
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Polls `node`'s inbox until it holds `expected` (`None`: does not exist).
async fn expect_inbox(inboxes: &Api<ConfigMap>, node: &str, expected: Option<&[(&str, &str)]>) {
    let expected: Option<BTreeMap<String, String>> = expected.map(|pairs| {
        pairs
            .iter()
            .map(|(uid, entry)| (uid.to_string(), entry.to_string()))
            .collect()
    });
    let deadline = Instant::now() + DEADLINE;
    loop {
        let found = inboxes
            .get_opt(&inbox_name(node))
            .await
            .unwrap_or_else(|e| panic!("read the inbox of {node}: {e}"))
            .map(|inbox| inbox.data.unwrap_or_default());
        if found == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the inbox of {node} holds {found:?}, not {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Creates `node`'s inbox as another writer would, with one entry.
async fn create_by_hand(inboxes: &Api<ConfigMap>, node: &str, (uid, entry): (&str, &str)) {
    let inbox: ConfigMap = serde_json::from_value(json!({
        "metadata": {
            "name": inbox_name(node),
            "labels": {"genswap.dev/inbox-node": node},
            "annotations": {"genswap.dev/node": node},
        },
        "data": {uid: entry},
    }))
    .expect("a ConfigMap");
    inboxes
        .create(&PostParams::default(), &inbox)
        .await
        .unwrap_or_else(|e| panic!("create the inbox of {node}: {e}"));
}

async fn plane() -> Option<Client> {
    let Some(plane) = ControlPlane::shared() else {
        println!("skipped: no control plane can start here (../shared/kube)");
        return None;
    };
    Some(plane.client().await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inboxes_follow_the_attempts_and_a_new_leader_repairs_what_it_lists() {
    let Some(client) = plane().await else { return };
    let home = OwnNamespace::create(&client, "inbox-all").await;
    let inboxes: Api<ConfigMap> = Api::namespaced(client.clone(), &home.name);

    let index = InboxIndex::new();
    index.observe(&Event::Init);
    index.observe(&Event::InitApply(attempt("apps", "a1", "n1", "u1")));
    index.observe(&Event::InitApply(attempt("apps", "a2", "n1", "u2")));
    index.observe(&Event::InitApply(attempt("web", "a3", "n2", "u3")));
    index.observe(&Event::InitDone);
    let keeper = Keeper::start(&client, &home.name, Scope(None), &index);
    expect_inbox(
        &inboxes,
        "n1",
        Some(&[("u1", "apps/a1"), ("u2", "apps/a2")]),
    )
    .await;
    expect_inbox(&inboxes, "n2", Some(&[("u3", "web/a3")])).await;
    let n1 = inboxes.get(&inbox_name("n1")).await.expect("n1's inbox");
    assert_eq!(
        n1.labels()
            .get("genswap.dev/inbox-node")
            .map(String::as_str),
        Some("n1")
    );

    // A new attempt and a deleted one change only their entries; an inbox
    // left empty is deleted.
    index.observe(&Event::Apply(attempt("apps", "a4", "n1", "u4")));
    index.observe(&Event::Delete(attempt("apps", "a1", "n1", "u1")));
    index.observe(&Event::Delete(attempt("web", "a3", "n2", "u3")));
    expect_inbox(
        &inboxes,
        "n1",
        Some(&[("u2", "apps/a2"), ("u4", "apps/a4")]),
    )
    .await;
    expect_inbox(&inboxes, "n2", None).await;

    // The leader goes; meanwhile the inbox gains an entry nobody keeps
    // (a write of an older leader) and n2 gets one written by hand. The
    // next leader lists both and puts them right.
    drop(keeper);
    let stale = json!({"data": {"u9": "apps/gone"}});
    inboxes
        .patch(
            &inbox_name("n1"),
            &PatchParams::default(),
            &Patch::Merge(&stale),
        )
        .await
        .expect("patch n1's inbox");
    create_by_hand(&inboxes, "n2", ("u8", "apps/old")).await;
    let _keeper = Keeper::start(&client, &home.name, Scope(None), &index);
    expect_inbox(
        &inboxes,
        "n1",
        Some(&[("u2", "apps/a2"), ("u4", "apps/a4")]),
    )
    .await;
    expect_inbox(&inboxes, "n2", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoped_controller_writes_its_own_entries_and_leaves_the_rest() {
    let Some(client) = plane().await else { return };
    let home = OwnNamespace::create(&client, "inbox-scoped").await;
    let inboxes: Api<ConfigMap> = Api::namespaced(client.clone(), &home.name);
    // Another scope's controller got there first.
    create_by_hand(&inboxes, "n1", ("t1", "theirs/x")).await;

    let index = InboxIndex::new();
    index.observe(&Event::Init);
    index.observe(&Event::InitApply(attempt("apps", "a1", "n1", "u1")));
    index.observe(&Event::InitDone);
    let _keeper = Keeper::start(&client, &home.name, Scope(Some("apps".into())), &index);
    expect_inbox(
        &inboxes,
        "n1",
        Some(&[("t1", "theirs/x"), ("u1", "apps/a1")]),
    )
    .await;

    // Its last attempt gone: its entry goes, the inbox and theirs stay.
    index.observe(&Event::Delete(attempt("apps", "a1", "n1", "u1")));
    expect_inbox(&inboxes, "n1", Some(&[("t1", "theirs/x")])).await;
}

/// The attempt's last state as a delete delivers it once its agent
/// reported an outcome.
fn finished(attempt: DeserializeGuard<SwapAttempt>) -> DeserializeGuard<SwapAttempt> {
    let mut attempt = attempt.0.expect("built whole");
    attempt.status = Some(SwapAttemptStatus {
        outcome: Some(Outcome::Done),
        ..SwapAttemptStatus::default()
    });
    DeserializeGuard(Ok(attempt))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_finished_attempt_leaves_with_the_nodes_next_write() {
    let Some(client) = plane().await else { return };
    let home = OwnNamespace::create(&client, "inbox-release").await;
    let inboxes: Api<ConfigMap> = Api::namespaced(client.clone(), &home.name);

    let index = InboxIndex::new();
    index.observe(&Event::Init);
    index.observe(&Event::InitApply(attempt("apps", "a1", "n1", "u1")));
    index.observe(&Event::InitApply(attempt("apps", "a2", "n1", "u2")));
    index.observe(&Event::InitApply(attempt("apps", "a3", "n1", "u3")));
    index.observe(&Event::InitDone);
    let _keeper = Keeper::start(&client, &home.name, Scope(None), &index);
    expect_inbox(
        &inboxes,
        "n1",
        Some(&[("u1", "apps/a1"), ("u2", "apps/a2"), ("u3", "apps/a3")]),
    )
    .await;

    // a1 finished and was replaced: nothing is written for it (the index
    // tests show the node is not marked). The node's next attempt takes it
    // out in the same write.
    index.observe(&Event::Delete(finished(attempt("apps", "a1", "n1", "u1"))));
    index.observe(&Event::Apply(attempt("apps", "a4", "n1", "u4")));
    expect_inbox(
        &inboxes,
        "n1",
        Some(&[("u2", "apps/a2"), ("u3", "apps/a3"), ("u4", "apps/a4")]),
    )
    .await;

    // a2 finished and was replaced too, and waits; a3 is deleted before its
    // outcome, which is written at once, and a2 leaves in that write.
    index.observe(&Event::Delete(finished(attempt("apps", "a2", "n1", "u2"))));
    index.observe(&Event::Delete(attempt("apps", "a3", "n1", "u3")));
    expect_inbox(&inboxes, "n1", Some(&[("u4", "apps/a4")])).await;
}
