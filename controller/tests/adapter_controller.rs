//! The whole Controller (watches, caches, triggers, leadership, readiness,
//! shutdown) with the real scheduler, against an in-memory API server that
//! answers lists and streams watch events.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::channel::mpsc;
use genswap_controller::http::Readiness;
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_controller::run::{Settings, run_controller};
use genswap_controller::shutdown;
use http::{Method, Request, Response, StatusCode};
use kube::Client;
use serde_json::{Value, json};

const NS: &str = "apps";
const DEADLINE: Duration = Duration::from_secs(30);
const SHA: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

type ResponseBody = axum::body::Body;
type Chunk = Result<Bytes, Infallible>;

/// The three kinds the controller watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Ig,
    Attempt,
    Node,
}

impl Kind {
    fn collection(self) -> String {
        match self {
            Kind::Ig => format!("/apis/genswap.dev/v1alpha1/namespaces/{NS}/instancegenerations"),
            Kind::Attempt => format!("/apis/genswap.dev/v1alpha1/namespaces/{NS}/swapattempts"),
            Kind::Node => "/api/v1/nodes".to_string(),
        }
    }

    fn list_type(self) -> (&'static str, &'static str) {
        match self {
            Kind::Ig => ("genswap.dev/v1alpha1", "InstanceGenerationList"),
            Kind::Attempt => ("genswap.dev/v1alpha1", "SwapAttemptList"),
            Kind::Node => ("v1", "NodeList"),
        }
    }
}

#[derive(Default)]
struct Cluster {
    objects: BTreeMap<Kind, BTreeMap<String, Value>>,
    watchers: BTreeMap<Kind, Vec<mpsc::UnboundedSender<Chunk>>>,
    resource_version: u64,
    /// Every write the controller sent: "METHOD path".
    writes: Vec<String>,
    event_reasons: Vec<String>,
}

impl Cluster {
    /// Stores `object` (or removes it) and streams the change to watchers.
    fn put(&mut self, kind: Kind, mut object: Value, deleted: bool) {
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
        let line = Bytes::from(line);
        self.watchers
            .entry(kind)
            .or_default()
            .retain(|watcher| watcher.unbounded_send(Ok(line.clone())).is_ok());
    }

    fn get(&self, kind: Kind, name: &str) -> Option<Value> {
        self.objects.get(&kind)?.get(name).cloned()
    }

    fn answer(
        &mut self,
        method: &Method,
        path: &str,
        query: &str,
        body: Value,
    ) -> Response<ResponseBody> {
        for kind in [Kind::Ig, Kind::Attempt, Kind::Node] {
            if method == Method::GET && path == kind.collection() {
                return if query.split('&').any(|p| p == "watch=true") {
                    let (sender, receiver) = mpsc::unbounded();
                    self.watchers.entry(kind).or_default().push(sender);
                    Response::builder()
                        .status(StatusCode::OK)
                        .header(http::header::CONTENT_TYPE, "application/json")
                        .body(ResponseBody::from_stream(receiver))
                        .expect("response builds")
                } else {
                    let (api_version, list_kind) = kind.list_type();
                    let items: Vec<Value> = self
                        .objects
                        .get(&kind)
                        .map(|objects| objects.values().cloned().collect())
                        .unwrap_or_default();
                    respond(
                        StatusCode::OK,
                        &json!({
                            "apiVersion": api_version,
                            "kind": list_kind,
                            "metadata": { "resourceVersion": self.resource_version.to_string() },
                            "items": items,
                        }),
                    )
                };
            }
        }
        self.writes.push(format!("{method} {path}"));
        let igs = Kind::Ig.collection();
        let attempts = Kind::Attempt.collection();
        if method == Method::PATCH && path.starts_with(&igs) && path.ends_with("/status") {
            let name = body["metadata"]["name"].as_str().unwrap_or_default();
            let mut ig = self.get(Kind::Ig, name).expect("the IG exists");
            if body["metadata"]["resourceVersion"] != ig["metadata"]["resourceVersion"] {
                return respond(
                    StatusCode::CONFLICT,
                    &json!({"kind": "Status", "status": "Failure", "code": 409, "reason": "Conflict"}),
                );
            }
            ig["status"] = body["status"].clone();
            self.put(Kind::Ig, ig, false);
            respond(StatusCode::OK, &self.get(Kind::Ig, name))
        } else if method == Method::POST && path == attempts {
            self.put(Kind::Attempt, body.clone(), false);
            respond(StatusCode::CREATED, &body)
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
            self.event_reasons
                .push(body["reason"].as_str().unwrap_or_default().to_string());
            respond(StatusCode::CREATED, &body)
        } else {
            panic!("the fake API server does not expect {method} {path}?{query}");
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

/// A client whose requests `cluster` answers.
fn client(cluster: &Arc<Mutex<Cluster>>) -> Client {
    let (service, mut handle) =
        tower_test::mock::pair::<Request<kube::client::Body>, Response<ResponseBody>>();
    let cluster = cluster.clone();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let method = request.method().clone();
            let path = request.uri().path().to_string();
            let query = request.uri().query().unwrap_or_default().to_string();
            let bytes = request
                .into_body()
                .collect_bytes()
                .await
                .expect("request body readable");
            let body = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("request body is JSON")
            };
            let response = cluster
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .answer(&method, &path, &query, body);
            send.send_response(response);
        }
    });
    Client::new(service, NS)
}

fn ig() -> Value {
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

fn node(name: &str, pool: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name, "labels": { "pool": pool } },
        "status": { "images": [{ "names": ["registry.invalid/big:1"], "sizeBytes": 1 }] },
    })
}

async fn eventually(
    what: &str,
    cluster: &Arc<Mutex<Cluster>>,
    condition: impl Fn(&Cluster) -> bool,
) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if condition(&cluster.lock().unwrap_or_else(PoisonError::into_inner)) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ready_column(cluster: &Cluster) -> Option<String> {
    cluster.get(Kind::Ig, "web")?["status"]["ready"]
        .as_str()
        .map(str::to_string)
}

#[tokio::test]
async fn the_controller_follows_its_watches_and_writes_only_as_leader() {
    let cluster = Arc::new(Mutex::new(Cluster::default()));
    {
        let mut c = cluster.lock().unwrap_or_else(PoisonError::into_inner);
        c.put(Kind::Ig, ig(), false);
        c.put(Kind::Node, node("n1", "a"), false);
        c.put(Kind::Node, node("n2", "a"), false);
        c.put(Kind::Node, node("other", "z"), false);
    }
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    let readiness = Readiness::default();
    let (stop, stopped) = shutdown::channel();
    let controller = tokio::spawn(run_controller(
        client(&cluster),
        client(&cluster),
        Settings {
            namespace: Some(NS.into()),
            identity: "replica-a".into(),
            concurrency: 4,
        },
        metrics.clone(),
        leadership.clone(),
        readiness.clone(),
        stopped.wait(),
    ));

    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !readiness.is_ready() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "caches never synced"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        cluster
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .writes
            .is_empty(),
        "a follower with synced caches has written nothing"
    );

    // Becoming the leader re-plans everything: the canary is issued.
    leadership.set(true);
    eventually("the canary attempt on n1", &cluster, |c| {
        c.get(Kind::Attempt, "web-n1-1").is_some()
    })
    .await;
    {
        let c = cluster.lock().unwrap_or_else(PoisonError::into_inner);
        assert_eq!(
            c.writes[..2],
            [
                format!("PATCH {}/web/status", Kind::Ig.collection()),
                format!("POST {}", Kind::Attempt.collection()),
            ],
            "the reservation comes before the create"
        );
    }

    // The agent reports the canary done: its watch event re-plans the IG,
    // which records the outcome and issues the next node.
    {
        let mut c = cluster.lock().unwrap_or_else(PoisonError::into_inner);
        let mut attempt = c.get(Kind::Attempt, "web-n1-1").expect("canary exists");
        attempt["status"] = json!({"outcome": "done", "effectiveMode": "overlap", "generation": 1, "executed": true});
        c.put(Kind::Attempt, attempt, false);
    }
    eventually("the attempt on n2", &cluster, |c| {
        c.get(Kind::Attempt, "web-n2-2").is_some()
    })
    .await;
    eventually("n1 recorded as serving", &cluster, |c| {
        ready_column(c).as_deref() == Some("1/2")
    })
    .await;

    // A node joining the pool re-plans the IG that selects it ...
    cluster
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .put(Kind::Node, node("n3", "a"), false);
    eventually("n3 counted", &cluster, |c| {
        ready_column(c).as_deref() == Some("1/3")
    })
    .await;
    // ... and leaving it by a relabel re-plans it again.
    cluster
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .put(Kind::Node, node("n3", "z"), false);
    eventually("n3 no longer counted", &cluster, |c| {
        ready_column(c).as_deref() == Some("1/2")
    })
    .await;

    {
        let c = cluster.lock().unwrap_or_else(PoisonError::into_inner);
        for reason in ["AttemptIssued", "SwapDone"] {
            assert!(
                c.event_reasons.iter().any(|r| r == reason),
                "{reason}: {:?}",
                c.event_reasons
            );
        }
        let revs: Vec<i64> = c.objects[&Kind::Attempt]
            .values()
            .map(|a| a["spec"]["schedRev"].as_i64().expect("schedRev"))
            .collect();
        assert_eq!(revs, vec![1, 2]);
    }
    let text = metrics.encode().expect("metrics encode");
    assert!(
        text.contains(
            "genswap_controller_attempts_issued_total{cause=\"install\",mode=\"overlap\"} 2"
        ),
        "{text}"
    );
    assert!(
        text.contains("genswap_controller_outcomes_total{outcome=\"done\",mode=\"overlap\"} 1"),
        "{text}"
    );

    stop.fire();
    tokio::time::timeout(DEADLINE, controller)
        .await
        .expect("the controller stops on shutdown")
        .expect("controller task joined");
}
