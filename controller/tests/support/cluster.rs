//! An in-memory API server for the whole controller: it answers lists,
//! streams watch events from the resourceVersion a watch asks for (as the
//! real one does, so nothing written between a list and its watch is lost),
//! takes the controller's writes (keeping the resourceVersion precondition of
//! a status apply) and holds a Lease. A test can hold back one kind's watch
//! events to play a lagging watch, or take the whole server down. It is
//! reachable through a mocked client or over real HTTP on loopback.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::extract::State;
use bytes::Bytes;
use futures::channel::mpsc;
use http::{Method, Request, Response, StatusCode};
use kube::Client;
use serde_json::{Map, Value, json};

pub const NS: &str = "apps";
pub const LEASE: &str = "genswap-controller";
const SHA: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

pub type ResponseBody = axum::body::Body;
type Chunk = Result<Bytes, Infallible>;

/// The kinds the fake stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Ig,
    Attempt,
    Node,
    Lease,
}

impl Kind {
    pub fn collection(self) -> String {
        match self {
            Kind::Ig => format!("/apis/genswap.dev/v1alpha1/namespaces/{NS}/instancegenerations"),
            Kind::Attempt => format!("/apis/genswap.dev/v1alpha1/namespaces/{NS}/swapattempts"),
            Kind::Node => "/api/v1/nodes".to_string(),
            Kind::Lease => format!("/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"),
        }
    }

    fn list_type(self) -> (&'static str, &'static str) {
        match self {
            Kind::Ig => ("genswap.dev/v1alpha1", "InstanceGenerationList"),
            Kind::Attempt => ("genswap.dev/v1alpha1", "SwapAttemptList"),
            Kind::Node => ("v1", "NodeList"),
            Kind::Lease => ("coordination.k8s.io/v1", "LeaseList"),
        }
    }
}

/// One open watch: where it stands in its kind's history.
struct Watch {
    sender: mpsc::UnboundedSender<Chunk>,
    sent_up_to: u64,
}

/// What the fake holds and saw.
#[derive(Default)]
pub struct Cluster {
    objects: BTreeMap<Kind, BTreeMap<String, Value>>,
    /// Every change of each kind as a watch event line, by resourceVersion.
    history: BTreeMap<Kind, Vec<(u64, Bytes)>>,
    watchers: BTreeMap<Kind, Vec<Watch>>,
    /// Kinds whose watches are held back (their events are kept).
    held: BTreeSet<Kind>,
    resource_version: u64,
    /// Every genswap write the controller sent, as "METHOD path".
    pub writes: Vec<String>,
    /// Every Event created, as sent.
    pub events: Vec<Value>,
    /// While set, every request fails with 503 (see [`Cluster::go_down`]).
    down: bool,
    /// Requests that arrived while down.
    pub requests_while_down: usize,
}

/// A cluster shared by the test and the server side.
pub type Shared = Arc<Mutex<Cluster>>;

pub fn lock(cluster: &Shared) -> MutexGuard<'_, Cluster> {
    cluster.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Cluster {
    /// Stores `object` (or removes it) and streams the change to watchers.
    pub fn put(&mut self, kind: Kind, mut object: Value, deleted: bool) {
        self.resource_version += 1;
        object["metadata"]["resourceVersion"] = json!(self.resource_version.to_string());
        let name = object["metadata"]["name"]
            .as_str()
            .expect("object has a name")
            .to_string();
        let objects = self.objects.entry(kind).or_default();
        let event_type = if deleted {
            objects.remove(&name);
            "DELETED"
        } else if objects.insert(name, object.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let mut line =
            serde_json::to_vec(&json!({"type": event_type, "object": object})).expect("serializes");
        line.push(b'\n');
        self.history
            .entry(kind)
            .or_default()
            .push((self.resource_version, Bytes::from(line)));
        self.deliver(kind);
    }

    /// The server becomes unreachable: open watches are cut and every
    /// request fails with 503 until [`come_back`](Self::come_back).
    pub fn go_down(&mut self) {
        self.down = true;
        self.watchers.clear();
    }

    pub fn come_back(&mut self) {
        self.down = false;
    }

    /// How many watches of `kind` are open.
    pub fn open_watches(&self, kind: Kind) -> usize {
        self.watchers.get(&kind).map_or(0, Vec::len)
    }

    /// Holds back `kind`'s watch events: lists stay current, watches lag.
    pub fn hold_watch(&mut self, kind: Kind) {
        self.held.insert(kind);
    }

    /// Delivers everything held back for `kind`, and from then on at once.
    pub fn release_watch(&mut self, kind: Kind) {
        self.held.remove(&kind);
        self.deliver(kind);
    }

    /// Sends each open watch of `kind` the events it has not had yet.
    fn deliver(&mut self, kind: Kind) {
        if self.held.contains(&kind) {
            return;
        }
        let history = self.history.get(&kind).map(Vec::as_slice).unwrap_or(&[]);
        self.watchers.entry(kind).or_default().retain_mut(|watch| {
            for (version, line) in history {
                if *version > watch.sent_up_to {
                    if watch.sender.unbounded_send(Ok(line.clone())).is_err() {
                        return false;
                    }
                    watch.sent_up_to = *version;
                }
            }
            true
        });
    }

    pub fn get(&self, kind: Kind, name: &str) -> Option<Value> {
        self.objects.get(&kind)?.get(name).cloned()
    }

    /// Every stored object of `kind`, borrowed: what a loop polling a
    /// large cluster reads, so it does not copy the cluster each time.
    pub fn each(&self, kind: Kind) -> impl Iterator<Item = &Value> {
        self.objects
            .get(&kind)
            .into_iter()
            .flat_map(BTreeMap::values)
    }

    pub fn all(&self, kind: Kind) -> Vec<Value> {
        self.objects
            .get(&kind)
            .map(|objects| objects.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Writes what a node agent reports when `attempt` ended `done` as
    /// generation `generation`.
    pub fn report_done(&mut self, attempt: &str, generation: i64) {
        let mut object = self
            .get(Kind::Attempt, attempt)
            .expect("the attempt exists");
        object["status"] = json!({
            "outcome": "done",
            "effectiveMode": "overlap",
            "generation": generation,
            "executed": true,
        });
        self.put(Kind::Attempt, object, false);
    }

    /// The Lease's holder, if any.
    pub fn lease_holder(&self) -> Option<String> {
        self.get(Kind::Lease, LEASE)?["spec"]["holderIdentity"]
            .as_str()
            .map(str::to_string)
    }

    /// The IG's READY column (`ready/selected`).
    pub fn ready_column(&self) -> Option<String> {
        self.get(Kind::Ig, "web")?["status"]["ready"]
            .as_str()
            .map(str::to_string)
    }

    fn answer(
        &mut self,
        method: &Method,
        path: &str,
        query: &str,
        content_type: &str,
        body: Value,
    ) -> Response<ResponseBody> {
        if self.down {
            self.requests_while_down += 1;
            return failure(503, "ServiceUnavailable");
        }
        for kind in [Kind::Ig, Kind::Attempt, Kind::Node, Kind::Lease] {
            if method == Method::GET && path == kind.collection() {
                return self.list_or_watch(kind, query);
            }
        }
        let leases = Kind::Lease.collection();
        if path.starts_with(&leases) {
            return self.lease(method, path, content_type, body);
        }
        self.writes.push(format!("{method} {path}"));
        let igs = Kind::Ig.collection();
        let attempts = Kind::Attempt.collection();
        if method == Method::PATCH && path.starts_with(&igs) && path.ends_with("/status") {
            let name = body["metadata"]["name"].as_str().unwrap_or_default();
            let mut ig = self.get(Kind::Ig, name).expect("the IG exists");
            if body["metadata"]["resourceVersion"] != ig["metadata"]["resourceVersion"] {
                return failure(409, "Conflict");
            }
            ig["status"] = body["status"].clone();
            self.put(Kind::Ig, ig, false);
            respond(StatusCode::OK, &self.get(Kind::Ig, name))
        } else if method == Method::POST && path == attempts {
            self.put(Kind::Attempt, body.clone(), false);
            respond(StatusCode::CREATED, &body)
        } else if method == Method::PATCH && path.starts_with(&attempts) {
            // The node record: a merge patch of the annotations alone.
            let name = path.rsplit('/').next().unwrap_or_default();
            let Some(mut object) = self.get(Kind::Attempt, name) else {
                return failure(404, "NotFound");
            };
            let Some(annotations) = body["metadata"]["annotations"].as_object() else {
                panic!("an attempt patch other than its annotations: {body}");
            };
            for (key, value) in annotations {
                object["metadata"]["annotations"][key] = value.clone();
            }
            self.put(Kind::Attempt, object, false);
            respond(StatusCode::OK, &self.get(Kind::Attempt, name))
        } else if method == Method::DELETE && path.starts_with(&attempts) {
            let name = path.rsplit('/').next().unwrap_or_default();
            if let Some(object) = self.get(Kind::Attempt, name) {
                self.put(Kind::Attempt, object, true);
            }
            respond(
                StatusCode::OK,
                &json!({"kind": "Status", "status": "Success"}),
            )
        } else if method == Method::POST
            && path == format!("/apis/events.k8s.io/v1/namespaces/{NS}/events")
        {
            self.events.push(body.clone());
            respond(StatusCode::CREATED, &body)
        } else {
            panic!("the fake API server does not expect {method} {path}?{query}");
        }
    }

    fn list_or_watch(&mut self, kind: Kind, query: &str) -> Response<ResponseBody> {
        let params: Vec<(&str, &str)> = query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .collect();
        if params.contains(&("watch", "true")) {
            // From the version asked for; "0" or none means from now.
            let sent_up_to = params
                .iter()
                .find(|(key, _)| *key == "resourceVersion")
                .and_then(|(_, version)| version.parse().ok())
                .filter(|version| *version > 0)
                .unwrap_or(self.resource_version);
            let (sender, receiver) = mpsc::unbounded();
            self.watchers
                .entry(kind)
                .or_default()
                .push(Watch { sender, sent_up_to });
            self.deliver(kind);
            return Response::builder()
                .status(StatusCode::OK)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(ResponseBody::from_stream(receiver))
                .expect("response builds");
        }
        let (api_version, list_kind) = kind.list_type();
        respond(
            StatusCode::OK,
            &json!({
                "apiVersion": api_version,
                "kind": list_kind,
                "metadata": { "resourceVersion": self.resource_version.to_string() },
                "items": self.all(kind),
            }),
        )
    }

    /// GET, create, and merge-patch of the Lease. A server-side apply that
    /// claims a Lease someone else holds conflicts, as the field manager of
    /// `holderIdentity` would on a real API server.
    fn lease(
        &mut self,
        method: &Method,
        path: &str,
        content_type: &str,
        body: Value,
    ) -> Response<ResponseBody> {
        let item = format!("{}/{LEASE}", Kind::Lease.collection());
        let existing = self.get(Kind::Lease, LEASE);
        match (method.clone(), existing) {
            (Method::GET, Some(lease)) if path == item => respond(StatusCode::OK, &lease),
            (Method::GET, None) if path == item => failure(404, "NotFound"),
            (Method::POST, None) => {
                let lease = json!({
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": { "name": LEASE, "namespace": NS },
                    "spec": {},
                });
                self.put(Kind::Lease, lease, false);
                respond(StatusCode::CREATED, &self.get(Kind::Lease, LEASE))
            }
            (Method::POST, Some(_)) => failure(409, "AlreadyExists"),
            (Method::PATCH, Some(mut lease)) if path == item => {
                let claimant = body["spec"]["holderIdentity"].as_str();
                let holder = lease["spec"]["holderIdentity"].as_str();
                if content_type.starts_with("application/apply-patch")
                    && matches!((holder, claimant), (Some(h), Some(c)) if h != c)
                {
                    return failure(409, "Conflict");
                }
                let spec = lease["spec"]
                    .as_object_mut()
                    .expect("lease spec is an object");
                for (key, value) in body["spec"].as_object().cloned().unwrap_or_else(Map::new) {
                    if value.is_null() {
                        spec.remove(&key);
                    } else {
                        spec.insert(key, value);
                    }
                }
                self.put(Kind::Lease, lease, false);
                respond(StatusCode::OK, &self.get(Kind::Lease, LEASE))
            }
            (method, _) => panic!("the fake API server does not expect {method} {path}"),
        }
    }
}

fn respond(code: StatusCode, body: &impl serde::Serialize) -> Response<ResponseBody> {
    Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(ResponseBody::from(
            serde_json::to_vec(body).expect("serializes"),
        ))
        .expect("response builds")
}

fn failure(code: u16, reason: &str) -> Response<ResponseBody> {
    respond(
        StatusCode::from_u16(code).expect("valid status code"),
        &json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason}),
    )
}

fn parse(bytes: &[u8]) -> Value {
    if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(bytes).expect("request body is JSON")
    }
}

fn content_type(headers: &http::HeaderMap) -> String {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// A client whose requests `cluster` answers in process, one at a time.
pub fn client(cluster: &Shared) -> Client {
    let (service, mut handle) =
        tower_test::mock::pair::<Request<kube::client::Body>, Response<ResponseBody>>();
    let cluster = cluster.clone();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            send.send_response(answer_request(&cluster, request, None).await);
        }
    });
    Client::new(service, NS)
}

/// [`client`], answering requests concurrently and every write (anything
/// but a GET) only after `write_latency`, as a busy API server does. The
/// benchmarks' stand-in for a real server's round trip; it adds no queueing
/// of its own, which a real server under load would.
pub fn client_with_latency(cluster: &Shared, write_latency: std::time::Duration) -> Client {
    let (service, mut handle) =
        tower_test::mock::pair::<Request<kube::client::Body>, Response<ResponseBody>>();
    let cluster = cluster.clone();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let cluster = cluster.clone();
            tokio::spawn(async move {
                send.send_response(answer_request(&cluster, request, Some(write_latency)).await);
            });
        }
    });
    Client::new(service, NS)
}

/// `cluster`'s answer to one request of the mocked client, a write's after
/// `write_latency` when given.
async fn answer_request(
    cluster: &Shared,
    request: Request<kube::client::Body>,
    write_latency: Option<std::time::Duration>,
) -> Response<ResponseBody> {
    let (parts, body) = request.into_parts();
    let bytes = body.collect_bytes().await.expect("request body readable");
    if let Some(latency) = write_latency.filter(|_| parts.method != Method::GET) {
        tokio::time::sleep(latency).await;
    }
    lock(cluster).answer(
        &parts.method,
        parts.uri.path(),
        parts.uri.query().unwrap_or_default(),
        &content_type(&parts.headers),
        parse(&bytes),
    )
}

/// Serves `cluster` over HTTP on a loopback port until the task is aborted.
pub async fn serve_http(cluster: &Shared) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    async fn handle(
        State(cluster): State<Shared>,
        request: Request<axum::body::Body>,
    ) -> Response<ResponseBody> {
        let (parts, body) = request.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX)
            .await
            .expect("request body readable");
        lock(&cluster).answer(
            &parts.method,
            parts.uri.path(),
            parts.uri.query().unwrap_or_default(),
            &content_type(&parts.headers),
            parse(&bytes),
        )
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("bound address");
    let router = axum::Router::new()
        .fallback(handle)
        .with_state(cluster.clone());
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .await
            .expect("the fake API server serves");
    });
    (addr, server)
}

/// The IG `web`, selecting nodes with `pool=a`.
pub fn ig() -> Value {
    json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": { "name": "web", "namespace": NS, "uid": "uid-web", "generation": 1 },
        "spec": {
            "nodeSelector": { "pool": "a" },
            "build": { "id": "b1", "artifact": { "path": "/opt/web/b1" }, "sha256": SHA },
        },
    })
}

/// A Node in `pool`, with the bulky status real Nodes carry.
pub fn node(name: &str, pool: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name, "labels": { "pool": pool } },
        "status": { "images": [{ "names": ["registry.invalid/big:1"], "sizeBytes": 1 }] },
    })
}

/// A cluster with the IG and nodes n1, n2 (pool a) and `other` (pool z).
pub fn seeded() -> Shared {
    let cluster = Shared::default();
    {
        let mut c = lock(&cluster);
        c.put(Kind::Ig, ig(), false);
        c.put(Kind::Node, node("n1", "a"), false);
        c.put(Kind::Node, node("n2", "a"), false);
        c.put(Kind::Node, node("other", "z"), false);
    }
    cluster
}

/// Polls `condition` on the cluster until it holds or `deadline` passes.
pub async fn eventually(
    what: &str,
    cluster: &Shared,
    deadline: std::time::Duration,
    condition: impl Fn(&Cluster) -> bool,
) {
    super::poll_until(what, deadline, || condition(&lock(cluster))).await;
}
