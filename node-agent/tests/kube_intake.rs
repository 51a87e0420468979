//! Kubernetes mode end to end against a mocked API server and a real node
//! (real engine, cgroup v2, testapp processes, sockets): the watch asks only
//! for this node's attempts; an attempt goes in, runs on the engine, and its
//! outcome comes out as a server-side apply; finished and superseded
//! attempts never run; a newer attempt arriving mid-swap makes the gate
//! refuse the older one; a second agent runs nothing until it owns the node;
//! shutdown cancels what is in flight and leaves the serving generation.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "kube_support/node.rs"]
mod kube_node;
mod kube_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use genswap_crds::{Cause, InstanceKind, Mode, Outcome};
use http::{Method, StatusCode};
use kube_node::TestNode;
use kube_support::{
    ALL_ATTEMPTS, GROUP_PATH, NAMESPACE, condition, eventually, list_and_watch, mock_client, name,
    object, outcome_status, plain_spec, running_status, start_agent, test_config, unexpected,
};
use node_agent::gate::{AttemptGate, AttemptId, GatePoint, GateRefusal};
use node_agent::journal::{AttemptRef, OutcomeRecord, Record};
use node_agent::ownership::NodeLock;
use serde_json::json;

#[tokio::test]
async fn the_list_and_the_watch_ask_only_for_this_nodes_attempts() {
    let node = TestNode::new("kube-selector");
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let list = server.expect_list(ALL_ATTEMPTS, &[]).await;
    assert_eq!(list.method, Method::GET);
    assert!(
        list.raw_query
            .contains("fieldSelector=spec.nodeName%3Dnode-a"),
        "{}",
        list.raw_query
    );
    assert_eq!(list.query["fieldSelector"], "spec.nodeName=node-a");
    let (watch, _feed) = server.expect_watch(ALL_ATTEMPTS).await;
    assert!(
        watch
            .raw_query
            .contains("fieldSelector=spec.nodeName%3Dnode-a"),
        "{}",
        watch.raw_query
    );
    assert_eq!(watch.query["watch"], "true");
    eventually("ready: owner and synced", || agent.readiness.is_ready()).await;
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
}

#[tokio::test]
async fn with_a_namespace_only_that_namespace_is_watched() {
    let node = TestNode::new("kube-namespace");
    let (client, mut server) = mock_client();
    let mut config = test_config(&node.lock_path);
    config.namespace = Some(NAMESPACE.into());
    let agent = start_agent(client, node.engine.clone(), node.gate.clone(), config);
    let path = format!("{GROUP_PATH}/namespaces/{NAMESPACE}/swapattempts");
    let list = server.expect_list(&path, &[]).await;
    assert_eq!(list.query["fieldSelector"], "spec.nodeName=node-a");
    let (watch, _feed) = server.expect_watch(&path).await;
    assert_eq!(watch.query["fieldSelector"], "spec.nodeName=node-a");
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
}

#[tokio::test]
async fn an_attempt_runs_on_the_engine_and_its_outcome_is_applied_then_acknowledged() {
    let node = TestNode::new("kube-e2e");
    let kube_node::Installed {
        agent,
        server,
        feed: _feed,
        status,
        ..
    } = node.install_web_b1().await;
    assert_eq!(status["outcome"], "done", "{status:#}");
    assert_eq!(status["effectiveMode"], "overlap");
    assert_eq!(status["generation"], 1);
    assert_eq!(status["executed"], true);
    let steps: Vec<&str> = status["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter_map(|s| s["step"].as_str())
        .collect();
    for step in ["stage", "spawn", "health", "switch"] {
        assert!(steps.contains(&step), "{step} in {steps:?}");
    }
    assert_eq!(condition(&status, "Ready")["status"], "True");
    assert_eq!(condition(&status, "Ready")["observedGeneration"], 1);
    assert_eq!(condition(&status, "Reconciling")["status"], "False");
    eventually("the outcome acknowledged in the journal", || {
        node.pending().is_empty()
    })
    .await;
    let serving = node.who_serves("web").await.expect("b1 serves");
    assert_eq!((serving.build.as_str(), serving.generation), ("b1", 1));
    let metrics = agent.metrics.encode().expect("metrics");
    assert!(
        metrics.contains(r#"genswap_agent_attempts_total{outcome="done",mode="overlap"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains("genswap_agent_generations_running 1"),
        "{metrics}"
    );

    agent.stop().await.expect("clean stop");
    assert_eq!(
        node.who_serves("web").await,
        Some(serving),
        "the serving generation outlives the agent"
    );
    assert_eq!(unexpected(server).await, Vec::<String>::new());
    node.tear_down(&["web"]).await;
}

#[tokio::test]
async fn an_attempt_that_ends_within_the_running_report_delay_writes_only_its_outcome() {
    let node = TestNode::new("kube-no-running");
    // Refused at staging (the build is not there): it ends at once.
    let db1 = object(&plain_spec("db", 1));
    let (client, mut server) = mock_client();
    let agent = node.start_agent_with(client, |config| {
        config.running_report_delay = std::time::Duration::from_secs(600);
    });
    let _feed = list_and_watch(&mut server, std::slice::from_ref(&db1)).await;
    let db = outcome_status(&mut server, &db1).await;
    assert_eq!(db["outcome"], "abandoned", "{db:#}");
    assert!(db["startedAt"].is_string(), "{db:#}");
    assert_eq!(condition(&db, "Reconciling")["status"], "False");
    eventually("db rev 1 acknowledged", || node.pending().is_empty()).await;
    agent.stop().await.expect("clean stop");
    assert_eq!(
        unexpected(server).await,
        Vec::<String>::new(),
        "no running status was written"
    );
}

#[tokio::test]
async fn finished_attempts_never_run_again_and_the_journal_is_delivered_first() {
    let node = TestNode::new("kube-never-twice");
    // The previous agent finished web rev 2 but its outcome was never accepted.
    let mut record = Record::admitted(
        node.key("web"),
        AttemptRef {
            name: name("web", 2),
            uid: None,
            sched_rev: 2,
        },
        Cause::Release,
        InstanceKind::Instance,
        Mode::Overlap,
        Mode::Overlap,
    );
    record.finish(OutcomeRecord {
        outcome: Outcome::Done,
        effective_mode: Mode::Overlap,
        generation: Some(4),
        reason: String::new(),
        executed: true,
        clean_exit: false,
        drain_ms: Some(30),
        listener_handover: None,
        steps: Vec::new(),
        started_at_ms: 1_750_000_000_000,
        finished_at_ms: 1_750_000_002_000,
    });
    node.engine.journal().record(&record).expect("journal it");
    let web2 = object(&plain_spec("web", 2));
    // web rev 1 has its outcome on the server already.
    let mut web1 = object(&plain_spec("web", 1));
    web1["status"] = json!({ "outcome": "done", "executed": true });
    // db rev 1 is new: it runs (and is refused at staging, nothing spawns).
    let db1 = object(&plain_spec("db", 1));

    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let _feed = list_and_watch(&mut server, &[web1.clone(), web2.clone(), db1.clone()]).await;
    let delivered = outcome_status(&mut server, &web2).await;
    assert_eq!(delivered["outcome"], "done");
    assert_eq!(delivered["generation"], 4, "the journal's outcome");
    // db rev 1 runs on its watched copy while web rev 2's outcome is
    // acknowledged, so the journal empties once both are.
    running_status(&mut server, &db1).await;
    let db = outcome_status(&mut server, &db1).await;
    assert_eq!(db["outcome"], "abandoned");
    assert_eq!(db["executed"], false);
    eventually("web rev 2 and db rev 1 acknowledged", || {
        node.pending().is_empty()
    })
    .await;

    agent.stop().await.expect("clean stop");
    let left = unexpected(server).await;
    assert_eq!(
        left,
        Vec::<String>::new(),
        "web 1 and web 2 were never read or run"
    );
}

#[tokio::test]
async fn an_attempt_older_than_the_newest_is_abandoned_without_running() {
    let node = TestNode::new("kube-superseded");
    let web1 = object(&plain_spec("web", 1));
    let web2 = object(&plain_spec("web", 2));
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let _feed = list_and_watch(&mut server, &[web1.clone(), web2.clone()]).await;
    let older = outcome_status(&mut server, &web1).await;
    assert_eq!(older["outcome"], "abandoned");
    assert_eq!(older["executed"], false);
    assert_eq!(older["reason"], "superseded by schedRev 2");
    assert!(older.get("generation").is_none(), "{older:#}");
    assert_eq!(condition(&older, "Ready")["reason"], "Abandoned");
    assert_eq!(condition(&older, "Stalled")["status"], "False");
    running_status(&mut server, &web2).await;
    outcome_status(&mut server, &web2).await;
    agent.stop().await.expect("clean stop");
    assert_eq!(
        unexpected(server).await,
        Vec::<String>::new(),
        "rev 1 was never read for running"
    );
}

#[tokio::test]
async fn a_newer_attempt_arriving_mid_swap_makes_the_gate_refuse_the_older_one() {
    let node = TestNode::new("kube-mid-swap");
    let b1 = node.build("b1");
    let b2 = node.build("b2");
    let mut slow = node.spec("web", 1, &b1, "b1");
    // Healthy only after 4 s: rev 2 arrives while rev 1 waits for health.
    slow.process.env.push(genswap_crds::EnvVar {
        name: "TESTAPP_BOOT_DELAY_MS".into(),
        value: "4000".into(),
    });
    let web1 = object(&slow);
    let web2 = object(&node.spec("web", 2, &b2, "b2"));
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let feed = list_and_watch(&mut server, &[]).await;
    feed.added(&web1);
    running_status(&mut server, &web1).await;
    let spawned = node.generation_cgroup("web", 1);
    eventually("rev 1's successor spawned", || spawned.exists()).await;

    feed.added(&web2);
    let refused = outcome_status(&mut server, &web1).await;
    assert_eq!(refused["outcome"], "abandoned", "{refused:#}");
    assert_eq!(refused["executed"], true, "its successor had started");
    let reason = refused["reason"].as_str().expect("a reason");
    assert!(
        reason.contains("superseded") && reason.contains("schedRev 2"),
        "{reason}"
    );
    running_status(&mut server, &web2).await;
    let done = outcome_status(&mut server, &web2).await;
    assert_eq!(done["outcome"], "done", "{done:#}");
    let serving = node.who_serves("web").await.expect("b2 serves");
    assert_eq!(serving.build, "b2");
    assert!(
        !spawned.exists(),
        "rev 1's successor was stopped and removed"
    );

    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
    node.tear_down(&["web"]).await;
}

#[tokio::test]
async fn a_second_agent_runs_nothing_until_it_owns_the_node() {
    let node = TestNode::new("kube-waits");
    let held = NodeLock::try_acquire(&node.lock_path)
        .expect("lock file")
        .expect("the test holds the node");
    let web1 = object(&plain_spec("web", 1));
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    // The watch is warm while the agent waits.
    let feed = list_and_watch(&mut server, std::slice::from_ref(&web1)).await;
    let web = node.key("web");
    eventually("the gate learns rev 1", || {
        node.gate.newest(&web) == Some(1)
    })
    .await;
    let db1 = object(&plain_spec("db", 1));
    feed.added(&db1);
    let db = node.key("db");
    eventually("the gate learns db rev 1", || {
        node.gate.newest(&db) == Some(1)
    })
    .await;
    assert!(!agent.readiness.is_ready());
    assert_eq!(
        agent.readiness.not_ready_because(),
        Some("waiting for the node lock: another agent owns this node")
    );
    let id = AttemptId {
        instance: web.clone(),
        sched_rev: 1,
    };
    assert_eq!(
        node.gate.check(GatePoint::Admission, &id),
        Err(GateRefusal::NotOwner)
    );

    drop(held);
    // Owner now: both run once.
    for attempt in [&web1, &db1] {
        running_status(&mut server, attempt).await;
        let status = outcome_status(&mut server, attempt).await;
        let reason = status["reason"].as_str().unwrap_or_default();
        assert!(!reason.contains("does not own the node"), "{reason}");
    }
    eventually("ready", || agent.readiness.is_ready()).await;
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
}

#[tokio::test]
async fn shutdown_cancels_the_attempt_in_flight_and_leaves_the_serving_generation() {
    let node = TestNode::new("kube-shutdown");
    let b1 = node.build("b1");
    let b2 = node.build("b2");
    let web1 = object(&node.spec("web", 1, &b1, "b1"));
    let mut never_healthy = node.spec("web", 2, &b2, "b2");
    never_healthy.process.env.push(genswap_crds::EnvVar {
        name: "TESTAPP_NEVER_BIND".into(),
        value: "1".into(),
    });
    let web2 = object(&never_healthy);
    let (client, mut server) = mock_client();
    let mut agent = node.start_agent(client);
    let feed = list_and_watch(&mut server, std::slice::from_ref(&web1)).await;
    running_status(&mut server, &web1).await;
    assert_eq!(outcome_status(&mut server, &web1).await["outcome"], "done");
    let serving = node.who_serves("web").await.expect("b1 serves");

    feed.added(&web2);
    running_status(&mut server, &web2).await;
    let successor = node.generation_cgroup("web", 2);
    eventually("rev 2's successor spawned", || successor.exists()).await;

    agent.begin_stop();
    let cancelled = outcome_status(&mut server, &web2).await;
    assert_eq!(cancelled["outcome"], "abandoned", "{cancelled:#}");
    assert_eq!(cancelled["executed"], true);
    let reason = cancelled["reason"].as_str().expect("a reason");
    assert!(reason.contains("shutting down"), "{reason}");
    agent.stop().await.expect("clean stop");

    assert_eq!(
        node.who_serves("web").await,
        Some(serving),
        "b1 still serves"
    );
    assert!(!successor.exists(), "the cancelled successor is gone");
    let id = AttemptId {
        instance: node.key("web"),
        sched_rev: 3,
    };
    assert_eq!(
        node.gate.check(GatePoint::Admission, &id),
        Err(GateRefusal::ShuttingDown)
    );
    assert_eq!(unexpected(server).await, Vec::<String>::new());
    node.tear_down(&["web"]).await;
}

#[tokio::test]
async fn a_deleted_attempt_is_cancelled_and_its_outcome_dropped_on_404() {
    let node = TestNode::new("kube-deleted");
    let b1 = node.build("b1");
    let mut never_healthy = node.spec("web", 1, &b1, "b1");
    never_healthy.process.env.push(genswap_crds::EnvVar {
        name: "TESTAPP_NEVER_BIND".into(),
        value: "1".into(),
    });
    let web1 = object(&never_healthy);
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let feed = list_and_watch(&mut server, std::slice::from_ref(&web1)).await;
    running_status(&mut server, &web1).await;
    let successor = node.generation_cgroup("web", 1);
    eventually("the successor spawned", || successor.exists()).await;

    feed.deleted(&web1);
    let write = server
        .expect_outcome_patch(NAMESPACE, &name("web", 1))
        .await;
    let status = write.request.body["status"].clone();
    assert_eq!(status["outcome"], "abandoned", "{status:#}");
    let reason = status["reason"].as_str().expect("a reason");
    assert!(reason.contains("deleted"), "{reason}");
    write.respond_status(
        StatusCode::NOT_FOUND,
        "NotFound",
        "swapattempts.genswap.dev \"web-node-a-1\" not found",
    );
    eventually("the outcome dropped from the journal", || {
        node.pending().is_empty()
    })
    .await;
    assert!(!successor.exists(), "the cancelled successor is gone");
    assert_eq!(node.who_serves("web").await, None);
    agent.stop().await.expect("clean stop");
    assert_eq!(
        unexpected(server).await,
        Vec::<String>::new(),
        "not retried"
    );
}
