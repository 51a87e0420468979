//! The agent's side of the node inbox on a real kube-apiserver
//! (`../shared/kube`, started by test-cluster; the test says in one line
//! that it skipped where there is none): an inbox that still lists an
//! attempt already deleted, as the controller leaves a replaced finished
//! attempt until the node's next one (docs/CONTROLLER.md, "Node inboxes"),
//! yields the attempts that exist and nothing for the one that is gone.

use std::time::Duration;

use futures::StreamExt;
use genswap_core::scheduler::inbox_name;
use genswap_crds::SwapAttempt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::Event;
use kube::{Client, ResourceExt};
use node_agent::kube::inbox::{InboxSource, attempts_from_inbox};
use serde_json::json;
use test_cluster::{ControlPlane, OwnNamespace};

const DEADLINE: Duration = Duration::from_secs(30);
const NODE: &str = "n1";

async fn create_attempt(client: &Client, namespace: &str, name: &str, rev: i64) -> SwapAttempt {
    let attempts: Api<SwapAttempt> = Api::namespaced(client.clone(), namespace);
    let object: SwapAttempt =
        serde_json::from_value(test_cluster::objects::swap_attempt(name, NODE, rev))
            .expect("a SwapAttempt");
    attempts
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create the attempt {name}: {e}"))
}

fn entry(namespace: &str, attempt: &SwapAttempt) -> (String, String) {
    (
        attempt.uid().unwrap_or_default(),
        format!("{namespace}/{}", attempt.name_any()),
    )
}

/// The names the next events carry, up to and including the first that
/// `last` accepts.
async fn names_until(
    events: &mut (
             impl futures::Stream<Item = kube::runtime::watcher::Result<Event<SwapAttempt>>> + Unpin
         ),
    last: impl Fn(&Event<SwapAttempt>) -> bool,
) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        let event = tokio::time::timeout(DEADLINE, events.next())
            .await
            .expect("the inbox's next event within the deadline")
            .expect("the stream goes on")
            .expect("no error reading the inbox or its attempts");
        match &event {
            Event::InitApply(attempt) => seen.push(format!("init {}", attempt.name_any())),
            Event::Apply(attempt) => seen.push(format!("apply {}", attempt.name_any())),
            Event::Delete(attempt) => seen.push(format!("delete {}", attempt.name_any())),
            Event::Init | Event::InitDone => {}
        }
        if last(&event) {
            return seen;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_attempt_that_is_gone_yields_nothing() {
    let Some(plane) = ControlPlane::shared() else {
        println!("skipped: no control plane can start here (../shared/kube)");
        return;
    };
    plane.install_crds();
    let client = plane.client().await;
    let home = OwnNamespace::create(&client, "agent-inbox").await;
    let namespace = home.name.clone();

    let replaced = create_attempt(&client, &namespace, "web-n1-1", 1).await;
    let current = create_attempt(&client, &namespace, "web-n1-2", 2).await;
    let attempts: Api<SwapAttempt> = Api::namespaced(client.clone(), &namespace);
    attempts
        .delete(&replaced.name_any(), &DeleteParams::default())
        .await
        .expect("delete the replaced attempt");
    let inboxes: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
    let data: serde_json::Map<String, serde_json::Value> =
        [entry(&namespace, &replaced), entry(&namespace, &current)]
            .into_iter()
            .map(|(uid, listed)| (uid, json!(listed)))
            .collect();
    let inbox: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": inbox_name(NODE)},
        "data": data,
    }))
    .expect("a ConfigMap");
    inboxes
        .create(&PostParams::default(), &inbox)
        .await
        .expect("create the inbox");

    let mut events = Box::pin(attempts_from_inbox(
        client.clone(),
        InboxSource {
            inbox_namespace: namespace.clone(),
            node_name: NODE.into(),
            attempts_namespace: None,
        },
    ));
    let listed = names_until(&mut events, |event| matches!(event, Event::InitDone)).await;
    assert_eq!(listed, vec!["init web-n1-2".to_string()]);

    // The node's next attempt: the controller's write adds it and takes
    // the gone one out, which the agent never delivered, so never deletes.
    let next = create_attempt(&client, &namespace, "web-n1-3", 3).await;
    let (uid, listed) = entry(&namespace, &next);
    let patch = json!({"data": {replaced.uid().unwrap_or_default(): null, uid: listed}});
    inboxes
        .patch(
            &inbox_name(NODE),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("patch the inbox");
    let changed = names_until(&mut events, |event| matches!(event, Event::Apply(_))).await;
    assert_eq!(changed, vec!["apply web-n1-3".to_string()]);
}
