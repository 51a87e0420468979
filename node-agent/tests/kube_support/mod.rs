//! A mocked API server for the Kubernetes-mode tests: the agent's client
//! talks to a `tower_test` mock, and an [`ApiServerVerifier`] takes each
//! request it sends, asserts it, and answers it. A test states the requests
//! the agent must send; requests it has not asked for yet wait in a backlog,
//! so the long-lived watch and the per-attempt writes may interleave freely.
//!
//! Include with `mod kube_support;`.
#![allow(dead_code)] // each test binary uses its own subset

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use genswap_crds::SwapAttemptSpec;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};

/// Every request must arrive within this; generous on purpose.
pub const DEADLINE: Duration = Duration::from_secs(30);
pub const NODE: &str = "node-a";
pub const NAMESPACE: &str = "apps";
pub const GROUP_PATH: &str = "/apis/genswap.dev/v1alpha1";

pub type ResponseBody = BoxBody<Bytes, Infallible>;
type Handle = tower_test::mock::Handle<Request<Body>, Response<ResponseBody>>;
type Responder = tower_test::mock::SendResponse<Response<ResponseBody>>;

/// A client over a mocked API server, and that server's side.
pub fn mock_client() -> (Client, ApiServerVerifier) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<ResponseBody>>();
    (
        Client::new(service, "default"),
        ApiServerVerifier {
            handle,
            backlog: Vec::new(),
            seen: Vec::new(),
        },
    )
}

/// A request as the API server received it.
#[derive(Clone, Debug)]
pub struct Captured {
    pub method: Method,
    pub path: String,
    /// The query exactly as sent (percent-encoded).
    pub raw_query: String,
    /// The query, decoded.
    pub query: BTreeMap<String, String>,
    pub content_type: Option<String>,
    /// The JSON body; `Null` when there is none.
    pub body: Value,
}

impl Captured {
    pub fn is_watch(&self) -> bool {
        self.query
            .get("watch")
            .is_some_and(|w| w == "true" || w == "1")
    }

    /// `METHOD path?query`, for messages.
    pub fn line(&self) -> String {
        format!("{} {}?{}", self.method, self.path, self.raw_query)
    }
}

/// A request waiting for its answer.
pub struct Pending {
    pub request: Captured,
    respond: Responder,
}

impl Pending {
    /// Answers with `code` and a JSON body.
    pub fn respond_json(self, code: StatusCode, body: &Value) {
        let bytes = Bytes::from(serde_json::to_vec(body).expect("JSON body"));
        let response = Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Full::new(bytes).boxed())
            .expect("response");
        self.respond.send_response(response);
    }

    /// Answers with a `metav1.Status` failure.
    pub fn respond_status(self, code: StatusCode, reason: &str, message: &str) {
        let body = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code.as_u16(),
        });
        self.respond_json(code, &body);
    }

    /// Answers a watch with a stream that stays open while the feed lives.
    pub fn respond_watch(self) -> WatchFeed {
        let (sender, receiver) = mpsc::unbounded::<Result<Frame<Bytes>, Infallible>>();
        let response = Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(StreamBody::new(receiver).boxed())
            .expect("response");
        self.respond.send_response(response);
        WatchFeed { sender }
    }
}

/// The open body of a watch: each event is one JSON line.
pub struct WatchFeed {
    sender: mpsc::UnboundedSender<Result<Frame<Bytes>, Infallible>>,
}

impl WatchFeed {
    fn send(&self, kind: &str, object: &Value) {
        let mut line =
            serde_json::to_vec(&json!({ "type": kind, "object": object })).expect("event");
        line.push(b'\n');
        self.sender
            .unbounded_send(Ok(Frame::data(Bytes::from(line))))
            .expect("the watch is still open");
    }

    pub fn added(&self, object: &Value) {
        self.send("ADDED", object);
    }

    pub fn modified(&self, object: &Value) {
        self.send("MODIFIED", object);
    }

    pub fn deleted(&self, object: &Value) {
        self.send("DELETED", object);
    }
}

/// The mocked API server's side of the client.
pub struct ApiServerVerifier {
    handle: Handle,
    backlog: Vec<Pending>,
    seen: Vec<String>,
}

impl ApiServerVerifier {
    /// The next request that `matches`, waiting up to [`DEADLINE`]; others
    /// that arrive meanwhile wait in the backlog.
    pub async fn next_where(&mut self, what: &str, matches: impl Fn(&Captured) -> bool) -> Pending {
        if let Some(i) = self.backlog.iter().position(|p| matches(&p.request)) {
            return self.backlog.remove(i);
        }
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let next = tokio::time::timeout_at(deadline, self.handle.next_request()).await;
            let (request, respond) = match next {
                Ok(Some(pair)) => pair,
                Ok(None) => panic!("the client went away before {what}; seen: {:#?}", self.seen),
                Err(_) => panic!(
                    "no request {what} within {DEADLINE:?}; seen: {:#?}; waiting: {:#?}",
                    self.seen,
                    self.backlog
                        .iter()
                        .map(|p| p.request.line())
                        .collect::<Vec<_>>()
                ),
            };
            let request = capture(request).await;
            self.seen.push(request.line());
            let pending = Pending { request, respond };
            if matches(&pending.request) {
                return pending;
            }
            self.backlog.push(pending);
        }
    }

    /// The initial list of SwapAttempts at `path`, answered with `items`.
    pub async fn expect_list(&mut self, path: &str, items: &[Value]) -> Captured {
        let pending = self
            .next_where(&format!("GET {path} (list)"), |r| {
                r.method == Method::GET && r.path == path && !r.is_watch()
            })
            .await;
        let request = pending.request.clone();
        pending.respond_json(
            StatusCode::OK,
            &json!({
                "apiVersion": "genswap.dev/v1alpha1",
                "kind": "SwapAttemptList",
                "metadata": { "resourceVersion": "100" },
                "items": items,
            }),
        );
        request
    }

    /// The watch at `path`, answered with an open stream.
    pub async fn expect_watch(&mut self, path: &str) -> (Captured, WatchFeed) {
        let pending = self
            .next_where(&format!("GET {path} (watch)"), |r| {
                r.method == Method::GET && r.path == path && r.is_watch()
            })
            .await;
        let request = pending.request.clone();
        (request, pending.respond_watch())
    }

    /// A status write of one attempt.
    pub async fn expect_status_patch(&mut self, namespace: &str, name: &str) -> Pending {
        let path = format!("{GROUP_PATH}/namespaces/{namespace}/swapattempts/{name}/status");
        self.next_where(&format!("PATCH {path}"), |r| {
            r.method == Method::PATCH && r.path == path
        })
        .await
    }

    /// A status write of one attempt that carries an outcome (the final
    /// report, not the running one).
    pub async fn expect_outcome_patch(&mut self, namespace: &str, name: &str) -> Pending {
        let path = format!("{GROUP_PATH}/namespaces/{namespace}/swapattempts/{name}/status");
        self.next_where(&format!("PATCH {path} with an outcome"), |r| {
            r.method == Method::PATCH && r.path == path && !r.body["status"]["outcome"].is_null()
        })
        .await
    }

    /// The running-status write of one attempt (no outcome).
    pub async fn expect_running_patch(&mut self, namespace: &str, name: &str) -> Pending {
        let path = format!("{GROUP_PATH}/namespaces/{namespace}/swapattempts/{name}/status");
        self.next_where(&format!("PATCH {path} without an outcome"), |r| {
            r.method == Method::PATCH
                && r.path == path
                && r.body["status"]["outcome"].is_null()
                && r.body["status"]["serving"].is_null()
        })
        .await
    }

    /// A write of one attempt's `serving` block whose body `matches`.
    pub async fn expect_serving_patch(
        &mut self,
        namespace: &str,
        name: &str,
        what: &str,
        matches: impl Fn(&Value) -> bool,
    ) -> Pending {
        let path = format!("{GROUP_PATH}/namespaces/{namespace}/swapattempts/{name}/status");
        self.next_where(&format!("PATCH {path} with serving {what}"), |r| {
            r.method == Method::PATCH
                && r.path == path
                && !r.body["status"]["serving"].is_null()
                && matches(&r.body["status"]["serving"])
        })
        .await
    }

    /// Every request still waiting or still to come until the client is
    /// dropped; call after the agent has stopped. Watch requests are left out.
    pub async fn remaining(mut self) -> Vec<Captured> {
        let mut left: Vec<Captured> = self.backlog.drain(..).map(|p| p.request).collect();
        loop {
            match tokio::time::timeout(DEADLINE, self.handle.next_request()).await {
                Ok(Some((request, _respond))) => left.push(capture(request).await),
                Ok(None) => break,
                Err(_) => panic!("the client was not dropped within {DEADLINE:?}"),
            }
        }
        left.retain(|r| !(r.method == Method::GET && r.is_watch()));
        left
    }
}

async fn capture(request: Request<Body>) -> Captured {
    let (parts, body) = request.into_parts();
    let bytes = body.collect_bytes().await.expect("request body");
    let raw_query = parts.uri.query().unwrap_or_default().to_string();
    let query = raw_query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect();
    Captured {
        method: parts.method,
        path: parts.uri.path().to_string(),
        raw_query,
        query,
        content_type: parts
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
        body: if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("a JSON request body")
        },
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A SwapAttempt object as the API server holds it.
pub fn attempt_object(
    namespace: &str,
    name: &str,
    spec: &SwapAttemptSpec,
    status: Option<Value>,
) -> Value {
    let mut object = json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "SwapAttempt",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": format!("uid-{name}"),
            "resourceVersion": "7",
            "generation": 1,
            "labels": { "genswap.dev/instance": spec.instance },
        },
        "spec": spec,
    });
    if let Some(status) = status {
        object["status"] = status;
    }
    object
}

/// A minimal spec for `instance` with revision `rev` on [`NODE`], for tests
/// in which the engine never gets to stage it.
pub fn plain_spec(instance: &str, rev: i64) -> SwapAttemptSpec {
    serde_json::from_value(json!({
        "instance": instance,
        "nodeName": NODE,
        "schedRev": rev,
        "cause": "release",
        "build": { "id": "b1", "artifact": { "path": "/nonexistent/b1" }, "sha256": "a".repeat(64) },
        "mode": "overlap",
    }))
    .expect("fixture spec")
}

/// The condition of `type_` in a status body.
pub fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status:#}"))
}

/// An agent running against the mocked API server.
pub struct RunningAgent {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), node_agent::kube::KubeAgentError>>>,
    pub metrics: std::sync::Arc<node_agent::metrics::AgentMetrics>,
    pub readiness: node_agent::metrics::Readiness,
}

/// The agent's settings in tests: the test node, fast retries, and every
/// running status written as its attempt starts (the tests check each).
pub fn test_config(lock_path: &std::path::Path) -> node_agent::kube::KubeAgentConfig {
    let mut config = node_agent::kube::KubeAgentConfig::new(NODE, lock_path);
    config.running_report_delay = Duration::ZERO;
    config.report_backoff = node_agent::kube::ReportBackoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(100),
    };
    config.shutdown_timeout = DEADLINE;
    config
}

/// Starts [`node_agent::kube::KubeAgent::run_until`] on a task.
pub fn start_agent(
    client: Client,
    engine: std::sync::Arc<node_agent::engine::Engine>,
    gate: std::sync::Arc<node_agent::gate::NewestRevisionGate>,
    config: node_agent::kube::KubeAgentConfig,
) -> RunningAgent {
    let metrics = std::sync::Arc::new(node_agent::metrics::AgentMetrics::new());
    let readiness = node_agent::metrics::Readiness::new();
    let agent = node_agent::kube::KubeAgent::new(
        client,
        engine,
        gate,
        config,
        metrics.clone(),
        readiness.clone(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(agent.run_until(async move {
        let _ = stopped.await;
    }));
    RunningAgent {
        stop: Some(stop),
        task: Some(task),
        metrics,
        readiness,
    }
}

impl RunningAgent {
    /// Asks the agent to shut down, as SIGTERM does.
    pub fn begin_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Shuts the agent down and waits for it.
    pub async fn stop(mut self) -> Result<(), node_agent::kube::KubeAgentError> {
        self.begin_stop();
        let task = self.task.take().expect("running");
        tokio::time::timeout(DEADLINE * 2, task)
            .await
            .expect("the agent stops in time")
            .expect("the agent task does not panic")
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Polls `condition` every 10 ms until it holds, failing after [`DEADLINE`].
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every namespace's SwapAttempts.
pub const ALL_ATTEMPTS: &str = "/apis/genswap.dev/v1alpha1/swapattempts";

/// The name the controller gives `instance`'s attempt `rev` on [`NODE`].
pub fn name(instance: &str, rev: i64) -> String {
    format!("{instance}-{NODE}-{rev}")
}

/// `spec` as the API server serves it, in [`NAMESPACE`].
pub fn object(spec: &SwapAttemptSpec) -> Value {
    attempt_object(NAMESPACE, &name(&spec.instance, spec.sched_rev), spec, None)
}

/// The list and the watch, answered with `items` and an open stream.
pub async fn list_and_watch(server: &mut ApiServerVerifier, items: &[Value]) -> WatchFeed {
    server.expect_list(ALL_ATTEMPTS, items).await;
    let (_, feed) = server.expect_watch(ALL_ATTEMPTS).await;
    feed
}

/// The running status of `object`, checked and accepted.
pub async fn running_status(server: &mut ApiServerVerifier, object: &Value) {
    let name = object["metadata"]["name"].as_str().expect("a name");
    let write = server.expect_running_patch(NAMESPACE, name).await;
    let status = write.request.body["status"].clone();
    assert!(status["startedAt"].is_string(), "{status:#}");
    assert_eq!(condition(&status, "Reconciling")["status"], "True");
    write.respond_json(StatusCode::OK, object);
}

/// The outcome written for `object`, accepted; returns its status.
pub async fn outcome_status(server: &mut ApiServerVerifier, object: &Value) -> Value {
    let name = object["metadata"]["name"].as_str().expect("a name");
    let write = server.expect_outcome_patch(NAMESPACE, name).await;
    assert_eq!(
        write.request.query.get("fieldManager").map(String::as_str),
        Some("genswap-node-agent")
    );
    let status = write.request.body["status"].clone();
    write.respond_json(StatusCode::OK, object);
    status
}

/// Every request the agent sent that no step of the test asked for.
pub async fn unexpected(server: ApiServerVerifier) -> Vec<String> {
    server.remaining().await.iter().map(|r| r.line()).collect()
}
