//! Kubernetes mode, staging ahead (`spec.stageOnly`, SPEC 5.15): while bytes
//! arrive the agent writes the ask's `status.stage`; an agent stopped
//! mid-download writes no outcome and leaves nothing in the store (no
//! entry, no temp file); the next agent stages the ask again, writes
//! `done` with `executed: false`, and starts nothing. Real store and
//! stager, a real HTTP server on loopback that holds back the second half
//! of the body, a mocked API server.
//!
//! What the mock cannot catch: the API server's own handling of the
//! writes (e2e/tests/cluster.rs stages asks through a real one).

#[path = "support/cgroup_guard.rs"]
mod cgroup_guard;
#[path = "kube_support/node.rs"]
mod kube_node;
mod kube_support;
#[path = "support/swap_host.rs"]
mod swap_host;

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use futures::StreamExt;
use genswap_crds::Artifact;
use http::{Response, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kube_node::TestNode;
use kube_support::{NAMESPACE, list_and_watch, mock_client, object, outcome_status, unexpected};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Serves one payload on every path: its length up front and its first
/// half at once, the second half only once released.
struct HeldBackServer {
    addr: SocketAddr,
    release: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Drop for HeldBackServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HeldBackServer {
    async fn start(payload: Bytes) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("address");
        let (release, released) = watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let payload = payload.clone();
                let released = released.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |_request| {
                        let payload = payload.clone();
                        let mut released = released.clone();
                        async move {
                            let half = payload.len() / 2;
                            let (first, rest) = (payload.slice(..half), payload.slice(half..));
                            let later = async move {
                                let _ = released.wait_for(|released| *released).await;
                                Ok::<_, Infallible>(Frame::data(rest))
                            };
                            let frames = futures::stream::once(async move {
                                Ok::<_, Infallible>(Frame::data(first))
                            })
                            .chain(futures::stream::once(later));
                            let body: UnsyncBoxBody<Bytes, Infallible> =
                                StreamBody::new(frames).boxed_unsync();
                            let mut response = Response::new(body);
                            response
                                .headers_mut()
                                .insert(header::CONTENT_LENGTH, payload.len().into());
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            release,
            task,
        }
    }

    fn release(&self) {
        self.release.send_replace(true);
    }
}

#[tokio::test]
async fn an_agent_stopped_mid_stage_writes_no_outcome_and_the_next_stages_the_ask_to_done() {
    let node = TestNode::new("kube-prestage");
    let b2 = node.build("b2");
    let payload = Bytes::from(std::fs::read(&b2.path).expect("read the build"));
    let sha256 = hex::encode(Sha256::digest(&payload));
    let server = HeldBackServer::start(payload.clone()).await;
    let mut spec = node.spec("web", 2, &b2, "b2");
    spec.stage_only = true;
    spec.build.sha256 = sha256.clone();
    spec.build.artifact = Artifact {
        url: Some(format!("http://{}/b2", server.addr)),
        ..Artifact::default()
    };
    let ask = object(&spec);
    let name = ask["metadata"]["name"]
        .as_str()
        .expect("a name")
        .to_string();
    let store = || node.engine.stager().store();

    // Half the body arrives: the agent says so on the ask, no outcome yet.
    let (client, mut api) = mock_client();
    let agent = node.start_agent(client);
    let _feed = list_and_watch(&mut api, std::slice::from_ref(&ask)).await;
    let progress = api.expect_running_patch(NAMESPACE, &name).await;
    let status = progress.request.body["status"].clone();
    assert_eq!(status["executed"], false, "{status:#}");
    let fetched = status["stage"]["fetchedBytes"].as_u64().unwrap_or_default();
    assert!(
        fetched > 0 && fetched < payload.len() as u64,
        "part of the body is counted: {status:#}"
    );
    assert_eq!(status["stage"]["totalBytes"], payload.len(), "{status:#}");
    progress.respond_json(http::StatusCode::OK, &ask);

    // Stopped mid-download: no outcome written, nothing stored.
    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(api).await, Vec::<String>::new());
    assert!(!store().entry_path(&sha256).exists(), "no entry stored");
    assert_eq!(
        store().remove_temp_files().expect("read the store"),
        0,
        "the cut download left no temp file"
    );

    // The next agent finds the ask without an outcome and stages it again.
    server.release();
    let (client, mut api) = mock_client();
    let agent = node.start_agent(client);
    let _feed = list_and_watch(&mut api, std::slice::from_ref(&ask)).await;
    let status = outcome_status(&mut api, &ask).await;
    assert_eq!(
        (&status["outcome"], &status["executed"]),
        (&serde_json::json!("done"), &serde_json::json!(false)),
        "{status:#}"
    );
    assert_eq!(status["stage"]["fetchedBytes"], payload.len(), "{status:#}");
    assert!(store().entry_path(&sha256).exists(), "the store holds b2");
    assert_eq!(node.who_serves("web").await, None, "nothing was started");

    agent.stop().await.expect("clean stop");
    assert_eq!(unexpected(api).await, Vec::<String>::new());
    node.tear_down(&["web"]).await;
}
