//! Kubernetes mode supervises between attempts (SPEC 5.10), against a
//! mocked API server and a real node: a SIGKILLed serving generation is
//! restarted by the agent without the API server's help, and its state is
//! applied as the install's `status.serving` with the supervisor's own
//! field manager, naming the exit, then the restart.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "kube_support/node.rs"]
mod kube_node;
mod kube_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use http::StatusCode;
use kube_node::TestNode;
use kube_support::{NAMESPACE, eventually, name, unexpected};

#[tokio::test]
async fn a_killed_generation_is_restarted_and_its_serving_block_applied() {
    let node = TestNode::new("kube-supervise");
    let kube_node::Installed {
        agent,
        mut server,
        feed: _feed,
        install,
        status,
    } = node.install_web_b1().await;
    assert_eq!(status["outcome"], "done", "{status:#}");
    eventually("the outcome acknowledged", || node.pending().is_empty()).await;
    let before = node.who_serves("web").await.expect("b1 serves");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(before.pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL the serving generation");

    let attempt = name("web", 1);
    let exited = server
        .expect_serving_patch(NAMESPACE, &attempt, "Exited", |s| s["state"] == "Exited")
        .await;
    assert_eq!(
        exited.request.query.get("fieldManager").map(String::as_str),
        Some("genswap-node-agent-supervisor"),
        "its own manager: the outcome's fields stay the outcome manager's"
    );
    let body = &exited.request.body;
    assert_eq!(
        body["status"]
            .as_object()
            .map(|s| s.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["serving".to_string()]),
        "only the serving block: {body:#}"
    );
    let serving = &body["status"]["serving"];
    assert_eq!(serving["generation"], 1, "{serving:#}");
    assert_eq!(serving["lastExit"]["signal"], 9, "{serving:#}");
    assert_eq!(serving["lastExit"]["generation"], 1, "{serving:#}");
    exited.respond_json(StatusCode::OK, &install);

    let running = server
        .expect_serving_patch(NAMESPACE, &attempt, "Running after one restart", |s| {
            s["state"] == "Running" && s["restarts"] == 1
        })
        .await;
    let serving = running.request.body["status"]["serving"].clone();
    assert_eq!(serving["generation"], 2, "{serving:#}");
    assert_eq!(
        serving["lastExit"]["signal"], 9,
        "the exit stays named: {serving:#}"
    );
    running.respond_json(StatusCode::OK, &install);

    let after = node.who_serves("web").await.expect("the restart serves");
    assert_eq!((after.build.as_str(), after.generation), ("b1", 2));
    let metrics = agent.metrics.encode().expect("metrics");
    for line in [
        r#"genswap_agent_generation_exits_total{reason="signaled"} 1"#,
        r#"genswap_agent_generation_restarts_total{reason="signaled"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    assert!(
        node.pending().is_empty(),
        "a restart is never an outcome to report"
    );
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
    node.tear_down(&["web"]).await;
}

/// A sidecar that crash-loops (SPEC 5.13) is reported in the install's
/// serving block with its exits and backoff, by the supervisor's manager,
/// while the generation serves on untouched.
#[tokio::test]
async fn a_crash_looping_sidecar_is_reported_in_the_serving_block() {
    let node = TestNode::new("kube-sidecar");
    let b1 = node.build("b1");
    let mut spec = node.spec("web", 1, &b1, "b1");
    spec.sidecars = vec![genswap_crds::SidecarSpec {
        name: "exporter".into(),
        build: None,
        process: genswap_crds::ProcessSpec {
            args: vec!["--exit-after-ms=30".into(), "--exit-code=4".into()],
            ..genswap_crds::ProcessSpec::default()
        },
        restart_policy: None,
        listeners: Vec::new(),
    }];
    let install = kube_support::object(&spec);
    let (client, mut server) = kube_support::mock_client();
    let _agent = node.start_agent(client);
    let _feed = kube_support::list_and_watch(&mut server, std::slice::from_ref(&install)).await;
    kube_support::running_status(&mut server, &install).await;
    let status = kube_support::outcome_status(&mut server, &install).await;
    assert_eq!(
        status["outcome"], "done",
        "a sidecar never fails a swap: {status:#}"
    );
    let before = node.who_serves("web").await.expect("b1 serves");

    let attempt = name("web", 1);
    let backing_off = server
        .expect_serving_patch(NAMESPACE, &attempt, "with the sidecar backing off", |s| {
            s["sidecars"][0]["state"] == "BackOff"
        })
        .await;
    assert_eq!(
        backing_off
            .request
            .query
            .get("fieldManager")
            .map(String::as_str),
        Some("genswap-node-agent-supervisor")
    );
    let serving = backing_off.request.body["status"]["serving"].clone();
    assert_eq!(
        serving["state"], "Running",
        "the generation serves: {serving:#}"
    );
    let sidecar = &serving["sidecars"][0];
    assert_eq!(sidecar["name"], "exporter", "{serving:#}");
    assert_eq!(sidecar["generation"], 1, "{serving:#}");
    assert_eq!(sidecar["lastExit"]["exitCode"], 4, "{serving:#}");
    assert!(
        sidecar["restarts"].as_i64().is_some_and(|r| r >= 2),
        "{serving:#}"
    );
    assert!(sidecar["restartAt"].is_string(), "{serving:#}");
    backing_off.respond_json(StatusCode::OK, &install);

    assert_eq!(
        node.who_serves("web").await.as_ref(),
        Some(&before),
        "the generation is untouched"
    );
}
