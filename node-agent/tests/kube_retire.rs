//! Kubernetes mode: an instance whose InstanceGeneration is deleted, whose
//! selector this node no longer matches, or whose namespace is being
//! deleted, is stopped on the node, with proof of exit; one whose attempts
//! are gone but whose object still exists and selects the node (someone
//! deleted the attempts) keeps serving, and is looked at again until
//! either changes; one deleted while no agent ran is stopped by the next
//! agent; an agent watching one namespace leaves the others' instances
//! alone; an ask to stage ahead keeps no instance serving. Real engine, cgroup v2 and testapp processes against a mocked API
//! server; e2e/tests/cluster.rs deletes a real namespace on a real one.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "kube_support/node.rs"]
mod kube_node;
mod kube_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use http::{Method, StatusCode};
use kube_node::TestNode;
use kube_support::{
    ApiServerVerifier, GROUP_PATH, NAMESPACE, NODE, Pending, RunningAgent, WatchFeed, eventually,
    list_and_watch, mock_client, object, outcome_status, running_status, unexpected,
};
use serde_json::{Value, json};
use swap_host::{Identity, alive};

/// The read of `instance`'s InstanceGeneration.
async fn expect_ig_read(server: &mut ApiServerVerifier, instance: &str) -> Pending {
    let path = format!("{GROUP_PATH}/namespaces/{NAMESPACE}/instancegenerations/{instance}");
    server
        .next_where(&format!("GET {path}"), |r| {
            r.method == Method::GET && r.path == path
        })
        .await
}

/// The read of `instance`'s InstanceGeneration, answered: it is deleted.
async fn answer_gone(server: &mut ApiServerVerifier, instance: &str) {
    expect_ig_read(server, instance).await.respond_status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("instancegenerations.genswap.dev \"{instance}\" not found"),
    );
}

/// `instance`'s InstanceGeneration, selecting nodes by `node_selector`.
fn ig_object(instance: &str, node_selector: Value) -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": { "name": instance, "namespace": NAMESPACE, "uid": "uid-1", "generation": 1 },
        "spec": {
            "nodeSelector": node_selector,
            "build": { "id": "b1", "artifact": { "path": "/opt/b1" }, "sha256": "a".repeat(64) },
        },
    })
}

/// The read of this node's Node.
async fn expect_node_read(server: &mut ApiServerVerifier) -> Pending {
    let path = format!("/api/v1/nodes/{NODE}");
    server
        .next_where(&format!("GET {path}"), |r| {
            r.method == Method::GET && r.path == path
        })
        .await
}

/// The read of the namespace the instances live in.
async fn expect_namespace_read(server: &mut ApiServerVerifier) -> Pending {
    let path = format!("/api/v1/namespaces/{NAMESPACE}");
    server
        .next_where(&format!("GET {path}"), |r| {
            r.method == Method::GET && r.path == path
        })
        .await
}

/// [`NAMESPACE`], and whether it is being deleted.
fn namespace_object(terminating: bool) -> Value {
    let mut namespace = json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": { "name": NAMESPACE },
        "status": { "phase": "Active" },
    });
    if terminating {
        namespace["metadata"]["deletionTimestamp"] = json!("2026-12-02T12:00:00Z");
        namespace["status"]["phase"] = json!("Terminating");
    }
    namespace
}

/// `web`'s attempt `install` is deleted, and the reads that follow
/// find `web` selecting `pool: edge` and this node labelled `labels`.
async fn attempt_deleted_on_node_labelled(
    server: &mut ApiServerVerifier,
    feed: &WatchFeed,
    install: &Value,
    labels: Value,
) {
    feed.deleted(install);
    expect_ig_read(server, "web")
        .await
        .respond_json(StatusCode::OK, &ig_object("web", json!({ "pool": "edge" })));
    let node = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": NODE, "labels": labels },
    });
    expect_node_read(server)
        .await
        .respond_json(StatusCode::OK, &node);
}

/// `web`'s attempt `install` is deleted while its object still exists and
/// selects this node, in a namespace that is being deleted or not.
async fn attempt_deleted_while_wanted(
    server: &mut ApiServerVerifier,
    feed: &WatchFeed,
    install: &Value,
    namespace_terminating: bool,
) {
    attempt_deleted_on_node_labelled(
        server,
        feed,
        install,
        json!({ "pool": "edge", "zone": "a" }),
    )
    .await;
    expect_namespace_read(server)
        .await
        .respond_json(StatusCode::OK, &namespace_object(namespace_terminating));
}

fn retirements(agent: &RunningAgent, result: &str) -> bool {
    agent
        .metrics
        .encode()
        .expect("metrics encode")
        .contains(&format!(
            "genswap_agent_retirements_total{{result=\"{result}\"}} 1"
        ))
}

/// Waits for the agent to count a retirement that stopped `web`, then checks
/// its process exited and nothing answers for it.
async fn assert_stopped(node: &TestNode, agent: &RunningAgent, serving: &Identity) {
    eventually("the instance stopped", || retirements(agent, "stopped")).await;
    assert!(!alive(serving.pid), "process {} exited", serving.pid);
    assert_eq!(node.who_serves("web").await, None, "nothing answers");
}

/// A node whose agent installed `web` and reported it done.
struct Serving {
    node: TestNode,
    server: ApiServerVerifier,
    agent: RunningAgent,
    /// The agent's watch of its attempts.
    feed: WatchFeed,
    /// The installing attempt.
    install: Value,
    /// Who answers for `web`.
    serving: Identity,
}

/// A fresh node `tag` whose agent installed `web` with attempt `rev`.
async fn serving_web(tag: &str, rev: i64) -> Serving {
    let node = TestNode::new(tag);
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let (feed, install) = installed(&node, &mut server, rev).await;
    let serving = node.who_serves("web").await.expect("b1 serves");
    Serving {
        node,
        server,
        agent,
        feed,
        install,
        serving,
    }
}

/// An agent that installed `web` (b1, generation 1) with attempt `rev` and
/// reported it done; returns its watch and the installing attempt.
async fn installed(
    node: &TestNode,
    server: &mut ApiServerVerifier,
    rev: i64,
) -> (WatchFeed, Value) {
    let b1 = node.build("b1");
    let install = object(&node.spec("web", rev, &b1, "b1"));
    let feed = list_and_watch(server, std::slice::from_ref(&install)).await;
    running_status(server, &install).await;
    let status = outcome_status(server, &install).await;
    assert_eq!(status["outcome"], "done", "{status:#}");
    eventually("the outcome acknowledged in the journal", || {
        node.pending().is_empty()
    })
    .await;
    (feed, install)
}

/// `web` issued again with attempt `rev` (a re-created object, a node
/// selected again) runs to done.
async fn installs_again(
    node: &TestNode,
    server: &mut ApiServerVerifier,
    feed: &WatchFeed,
    rev: i64,
) {
    let b1 = node.build("b1");
    let again = object(&node.spec("web", rev, &b1, "b1"));
    feed.added(&again);
    running_status(server, &again).await;
    let status = outcome_status(server, &again).await;
    assert_eq!(status["outcome"], "done", "{status:#}");
    assert!(node.who_serves("web").await.is_some(), "web serves again");
}

/// Stops the agent, checks it asked the API server nothing unexpected, and
/// stops `web` if it still serves.
async fn finish(node: &TestNode, agent: RunningAgent, server: ApiServerVerifier) {
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
    node.tear_down(&["web"]).await;
}

#[tokio::test]
async fn deleting_the_instance_generation_stops_its_instance_with_proof_of_exit() {
    let Serving {
        node,
        mut server,
        agent,
        feed,
        install,
        serving,
    } = serving_web("kube-retire", 3).await;
    let cgroup = node.generation_cgroup("web", 1);
    assert!(cgroup.exists());

    // The garbage collector deletes the attempt with its owner; the object
    // is gone, and so is its InstanceGeneration when read.
    feed.deleted(&install);
    answer_gone(&mut server, "web").await;
    assert_stopped(&node, &agent, &serving).await;
    assert!(!cgroup.exists(), "its cgroup is removed");
    assert_eq!(node.leftovers("web"), Vec::<std::path::PathBuf>::new());
    assert!(
        agent
            .metrics
            .encode()
            .expect("metrics encode")
            .contains("genswap_agent_generations_running 0"),
        "the gauge follows"
    );

    // The object is created again: its first attempt is revision 1, below
    // the old object's 3, and it runs (nothing remembers those revisions).
    installs_again(&node, &mut server, &feed, 1).await;

    finish(&node, agent, server).await;
}

#[tokio::test]
async fn an_instance_whose_object_still_exists_keeps_serving() {
    let Serving {
        node,
        mut server,
        agent,
        feed,
        install,
        serving,
    } = serving_web("kube-keep", 1).await;

    // The attempts are gone but the InstanceGeneration is not, and it still
    // selects this node (someone deleted the attempts by hand).
    attempt_deleted_while_wanted(&mut server, &feed, &install, false).await;
    eventually("the lookup concluded", || retirements(&agent, "kept")).await;
    assert_eq!(node.who_serves("web").await, Some(serving.clone()));

    // A lookup that fails concludes nothing either.
    let (client, mut server) = mock_client();
    agent.stop().await.expect("clean stop");
    let agent = node.start_agent(client);
    let _feed = list_and_watch(&mut server, &[]).await;
    expect_ig_read(&mut server, "web").await.respond_status(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        "etcd is having a bad day",
    );
    eventually("the failed lookup counted", || {
        retirements(&agent, "failed")
    })
    .await;
    assert_eq!(node.who_serves("web").await, Some(serving));

    finish(&node, agent, server).await;
}

#[tokio::test]
async fn an_instance_whose_namespace_is_being_deleted_is_stopped_though_its_object_remains() {
    let Serving {
        node,
        mut server,
        agent,
        feed,
        install,
        serving,
    } = serving_web("kube-retire-namespace", 1).await;

    // A namespace's deletion took the attempts first: the object is still
    // there, with no deletion mark of its own yet, and selects this node.
    attempt_deleted_while_wanted(&mut server, &feed, &install, true).await;
    assert_stopped(&node, &agent, &serving).await;
    assert_eq!(node.leftovers("web"), Vec::<std::path::PathBuf>::new());

    finish(&node, agent, server).await;
}

#[tokio::test]
async fn an_instance_kept_without_attempts_is_looked_at_again_and_stopped_once_its_object_is_gone()
{
    let node = TestNode::new("kube-retire-again");
    let (client, mut server) = mock_client();
    let agent = node.start_agent_with(client, |config| {
        config.look_again = std::time::Duration::from_millis(200);
    });
    let (feed, install) = installed(&node, &mut server, 1).await;
    let serving = node.who_serves("web").await.expect("b1 serves");

    // Kept: the object exists and selects this node.
    attempt_deleted_while_wanted(&mut server, &feed, &install, false).await;
    eventually("the lookup concluded", || retirements(&agent, "kept")).await;
    assert_eq!(node.who_serves("web").await, Some(serving.clone()));

    // The object is deleted afterwards, which no watch of the agent's
    // shows: the next look finds it gone.
    answer_gone(&mut server, "web").await;
    assert_stopped(&node, &agent, &serving).await;

    finish(&node, agent, server).await;
}

#[tokio::test]
async fn a_node_that_leaves_the_selector_stops_its_instance() {
    let Serving {
        node,
        mut server,
        agent,
        feed,
        install,
        serving,
    } = serving_web("kube-retire-unselected", 2).await;

    // The node was relabelled out of the selector: the controller deleted
    // its attempt, and the reads agree.
    attempt_deleted_on_node_labelled(&mut server, &feed, &install, json!({ "pool": "core" })).await;
    assert_stopped(&node, &agent, &serving).await;

    // Relabelled back, the node gets an install attempt with the object's
    // next revision, and it runs.
    installs_again(&node, &mut server, &feed, 3).await;

    finish(&node, agent, server).await;
}

#[tokio::test]
async fn an_ask_to_stage_ahead_deleted_after_the_swap_attempt_does_not_keep_the_instance() {
    let Serving {
        node,
        mut server,
        agent,
        feed,
        install,
        serving,
    } = serving_web("kube-retire-ask", 2).await;
    // The controller asked the node to stage b2 ahead of a release, and the
    // node holds it.
    let b2 = node.build("b2");
    let mut ask_spec = node.spec("web", 3, &b2, "b2");
    ask_spec.stage_only = true;
    let ask = object(&ask_spec);
    feed.added(&ask);
    let staged = outcome_status(&mut server, &ask).await;
    assert_eq!(
        (&staged["outcome"], &staged["executed"]),
        (&json!("done"), &json!(false)),
        "{staged:#}"
    );

    // The node left the selector and the controller deleted its attempts,
    // the swap attempt before the ask: the ask owns no instance, so the
    // instance is looked up and stopped before the ask goes.
    attempt_deleted_on_node_labelled(&mut server, &feed, &install, json!({ "pool": "core" })).await;
    assert_stopped(&node, &agent, &serving).await;
    feed.deleted(&ask);

    finish(&node, agent, server).await;
}

#[tokio::test]
async fn an_instance_on_a_node_whose_object_is_not_found_keeps_serving() {
    let Serving {
        node,
        mut server,
        agent,
        feed,
        install,
        serving,
    } = serving_web("kube-retire-nonode", 1).await;

    feed.deleted(&install);
    expect_ig_read(&mut server, "web")
        .await
        .respond_json(StatusCode::OK, &ig_object("web", json!({})));
    expect_node_read(&mut server).await.respond_status(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("nodes \"{NODE}\" not found"),
    );
    eventually("the lookup counted as failed", || {
        retirements(&agent, "failed")
    })
    .await;
    assert_eq!(node.who_serves("web").await, Some(serving));

    finish(&node, agent, server).await;
}

#[tokio::test]
async fn an_instance_deleted_while_no_agent_ran_is_stopped_by_the_next() {
    let Serving {
        node,
        server,
        agent,
        feed: _feed,
        install: _install,
        serving,
    } = serving_web("kube-retire-late", 1).await;
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
    assert!(alive(serving.pid), "the instance outlives the agent");

    // While no agent runs, the object and its attempts are deleted: the next
    // agent lists none, and looks the instance up once it owns the node.
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let _feed = list_and_watch(&mut server, &[]).await;
    answer_gone(&mut server, "web").await;
    assert_stopped(&node, &agent, &serving).await;

    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
}

#[tokio::test]
async fn an_agent_watching_one_namespace_leaves_other_namespaces_instances_alone() {
    let node = TestNode::new("kube-retire-scope");
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let (_feed, _install) = installed(&node, &mut server, 1).await;
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());

    // An agent scoped to another namespace sees no attempt of `apps/web`,
    // and has no right to read its object: it must not look it up.
    let (client, mut server) = mock_client();
    let mut config = kube_support::test_config(&node.lock_path);
    config.namespace = Some("other".into());
    let agent = kube_support::start_agent(client, node.engine.clone(), node.gate.clone(), config);
    let path = format!("{GROUP_PATH}/namespaces/other/swapattempts");
    server.expect_list(&path, &[]).await;
    let (_, _feed) = server.expect_watch(&path).await;
    eventually("the scoped agent ready", || agent.readiness.is_ready()).await;
    agent.stop().await.expect("clean stop");
    assert_eq!(
        unexpected(server).await,
        Vec::<String>::new(),
        "no lookup of an object outside the namespace"
    );
    assert!(node.who_serves("web").await.is_some(), "web still serves");
    node.tear_down(&["web"]).await;
}
