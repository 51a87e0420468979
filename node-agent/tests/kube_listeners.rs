//! Listeners in Kubernetes mode (SPEC 6.2), against a mocked API server and
//! a real node: an attempt's `spec.listeners` are bound and served on a
//! real 127.0.0.1 port, the done attempt's `status.serving` says which
//! listeners the agent holds, and a hold to the next build drops none of
//! the requests a client sends to the port without pause.

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "kube_support/node.rs"]
mod kube_node;
mod kube_support;
#[path = "support/swap_host.rs"]
mod swap_host;
#[path = "support/tcp_client.rs"]
mod tcp_client;

use genswap_crds::Mode;
use http::StatusCode;
use kube_node::TestNode;
use kube_support::{
    NAMESPACE, list_and_watch, mock_client, name, object, outcome_status, running_status,
    unexpected,
};
use serde_json::json;
use tcp_client::{Load, free_port, get, listener};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempts_listener_is_served_shown_in_status_and_kept_through_a_hold() {
    let node = TestNode::new("kube-listeners");
    let port = free_port();
    let held = json!([{ "name": "web", "address": format!("127.0.0.1:{port}") }]);
    let b1 = node.build("b1");
    let mut install = node.spec("web", 1, &b1, "b1");
    install.listeners = vec![listener(port)];
    let web1 = object(&install);
    let (client, mut server) = mock_client();
    let agent = node.start_agent(client);
    let feed = list_and_watch(&mut server, &[]).await;

    feed.added(&web1);
    running_status(&mut server, &web1).await;
    let done = outcome_status(&mut server, &web1).await;
    assert_eq!(done["outcome"], "done", "{done:#}");
    let shown = server
        .expect_serving_patch(NAMESPACE, &name("web", 1), "with its listener", |s| {
            s["listeners"].is_array()
        })
        .await;
    let serving = shown.request.body["status"]["serving"].clone();
    assert_eq!(serving["listeners"], held, "{serving:#}");
    assert_eq!(serving["state"], "Running", "{serving:#}");
    shown.respond_json(StatusCode::OK, &web1);
    assert!(
        get(port).is_ok_and(|body| body.contains("build=b1")),
        "b1 serves on the held port"
    );

    let load = Load::start(port);
    let b2 = node.build("b2");
    let mut release = node.spec("web", 2, &b2, "b2");
    release.mode = Mode::Hold;
    release.listeners = vec![listener(port)];
    let web2 = object(&release);
    feed.added(&web2);
    running_status(&mut server, &web2).await;
    let done = outcome_status(&mut server, &web2).await;
    assert_eq!(done["outcome"], "done", "{done:#}");
    assert_eq!(done["effectiveMode"], "hold", "{done:#}");
    let shown = server
        .expect_serving_patch(NAMESPACE, &name("web", 2), "with its listener", |s| {
            s["listeners"].is_array()
        })
        .await;
    assert_eq!(shown.request.body["status"]["serving"]["listeners"], held);
    shown.respond_json(StatusCode::OK, &web2);
    load.finish_with_none_failed();
    assert!(get(port).is_ok_and(|body| body.contains("build=b2")));

    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(server).await, Vec::<String>::new());
    node.tear_down(&["web"]).await;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "removing the instance closed its listener"
    );
}
