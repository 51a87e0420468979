//! Crash recovery in Kubernetes mode: a restarted agent, against a mocked
//! API server and a real node, recovers the attempt its predecessor left in
//! flight before it reads anything, delivers the recovered outcome once as a
//! server-side apply, never runs that attempt again, and keeps the serving
//! generation it adopted.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "kube_support/node.rs"]
mod kube_node;
#[path = "kube_support/mod.rs"]
mod kube_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::sync::Arc;

use genswap_crds::{Cause, InstanceKind, Mode, Outcome, StopSpec};
use genswap_store::{Stager, StagerConfig, Store};
use http::StatusCode;
use kube_node::TestNode;
use kube_support::{NAMESPACE, attempt_object, eventually, mock_client, start_agent, test_config};
use node_agent::cgroup::CgroupManager;
use node_agent::engine::{Attempt, Cancel, Engine, EngineConfig, EngineParts};
use node_agent::journal::{AttemptRef, Journal, Phase, Record};
use node_agent::logs::{LogSettings, LogSink};
use node_agent::switch::RunLayout;
use serde_json::json;
use swap_host::OpenGate;

use kube_support::ALL_ATTEMPTS;

fn name(instance: &str, rev: i64) -> String {
    format!("{instance}-{}-{rev}", kube_support::NODE)
}

/// A second engine over the node's directories: the restarted agent's.
fn restarted(node: &TestNode) -> Engine {
    let root = node
        .generation_cgroup("web", 1)
        .parent()
        .and_then(|instance| instance.parent())
        .expect("the cgroup root")
        .to_path_buf();
    let base = node.staging.parent().expect("the node's temp dir");
    let cgroups = CgroupManager::open(root).expect("the test cgroup root");
    let logs = LogSink::new(
        LogSettings::in_dir(base.join("logs"), env!("CARGO_BIN_EXE_genswap-helper")),
        &cgroups,
    )
    .expect("log sink");
    Engine::new(
        EngineParts {
            logs,
            cgroups,
            layout: RunLayout::new(base.join("run")),
            stager: Stager::new(
                Store::open(base.join("store")).expect("store"),
                StagerConfig::new(&node.staging),
            )
            .expect("stager"),
            journal: Journal::open(&node.state_dir).expect("journal"),
        },
        EngineConfig::default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_delivers_the_recovered_outcome_once_and_never_reruns_it() {
    let node = TestNode::new("rec-kube");
    let web = node.key("web");
    let v1 = node.build("v1");
    let v2 = node.build("v2");
    let install = Attempt {
        instance: web.clone(),
        name: name("web", 1),
        spec: node.spec("web", 1, &v1, "v1"),
        restart: None,
    };
    let installed = node.engine.swap(&install, &OpenGate, &Cancel::new()).await;
    assert_eq!(installed.outcome, Outcome::Done, "{installed:?}");
    node.engine
        .journal()
        .acknowledge(&web, 1)
        .expect("the install was reported");
    let serving = node.who_serves("web").await.expect("v1 answers");

    // The previous agent was killed right after journaling the release's
    // exec (phase spawning), before the successor's cgroup existed.
    let journal = node.engine.journal();
    let incumbent = journal.serving(&web).expect("journal").expect("v1 serves");
    let n = journal.next_generation(&web).expect("generation 2");
    let mut record = Record::admitted(
        web.clone(),
        AttemptRef {
            name: name("web", 2),
            uid: Some(format!("uid-{}", name("web", 2))),
            sched_rev: 2,
        },
        Cause::Release,
        InstanceKind::Instance,
        Mode::Overlap,
        Mode::Overlap,
    );
    let mut successor = incumbent.clone();
    successor.n = n;
    successor.build = "v2".into();
    successor.cgroup = node.generation_cgroup("web", n);
    successor.socket = incumbent.socket.with_file_name(format!("gen-{n}.sock"));
    successor.serving_since_ms = None;
    record.incumbent = Some(incumbent);
    record.successor = Some(successor);
    record.stop = Some(StopSpec::default());
    record.advance(Phase::Spawning);
    journal.record(&record).expect("journal the release");

    let engine = Arc::new(restarted(&node));
    let web1 = attempt_object(
        NAMESPACE,
        &name("web", 1),
        &node.spec("web", 1, &v1, "v1"),
        Some(json!({ "outcome": "done", "executed": true })),
    );
    let web2 = attempt_object(
        NAMESPACE,
        &name("web", 2),
        &node.spec("web", 2, &v2, "v2"),
        None,
    );
    let (client, mut server) = mock_client();
    let agent = start_agent(
        client,
        engine.clone(),
        node.gate.clone(),
        test_config(&node.lock_path),
    );
    server
        .expect_list(ALL_ATTEMPTS, &[web1.clone(), web2.clone()])
        .await;
    let (_, _feed) = server.expect_watch(ALL_ATTEMPTS).await;
    let write = server
        .expect_outcome_patch(NAMESPACE, &name("web", 2))
        .await;
    let status = write.request.body["status"].clone();
    write.respond_json(StatusCode::OK, &web2);
    assert_eq!(status["outcome"], "abandoned", "{status:#}");
    assert_eq!(
        status["executed"], true,
        "the journal reached spawning: {status:#}"
    );
    assert!(
        status["reason"]
            .as_str()
            .is_some_and(|r| r.contains("agent restarted")),
        "{status:#}"
    );
    eventually("the recovered outcome to be acknowledged", || {
        engine
            .journal()
            .pending_reports()
            .is_ok_and(|p| p.is_empty())
    })
    .await;

    agent.stop().await.expect("clean stop");
    let left: Vec<String> = server.remaining().await.iter().map(|r| r.line()).collect();
    assert_eq!(
        left,
        Vec::<String>::new(),
        "web rev 2 was never read or run again, nor reported twice"
    );
    let adopted = engine.serving(&web).expect("v1 adopted");
    assert_eq!(
        (adopted.generation, adopted.pid),
        (1, serving.pid),
        "the incumbent kept serving, adopted"
    );
    assert_eq!(node.who_serves("web").await, Some(serving));
    engine
        .stop_instance(&web, &StopSpec::default())
        .await
        .expect("stop web");
    assert!(
        !node.generation_cgroup("web", 1).exists() && !node.generation_cgroup("web", 2).exists()
    );
}
