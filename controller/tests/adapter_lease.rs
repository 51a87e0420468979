//! Leader election through kube-lease-manager against an in-memory Lease:
//! one replica leads, a leader cut off from the API server steps down on its
//! first failed renewal, the other takes over, and shutdown releases.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use genswap_controller::leader::{Leadership, LeaseSettings, hold_lease};
use genswap_controller::metrics::Metrics;
use genswap_controller::shutdown;
use http::{Method, Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use serde_json::{Map, Value, json};
use support::cluster::ResponseBody;

const NAMESPACE: &str = "genswap-system";
const LEASE: &str = "genswap-controller";
const DEADLINE: Duration = Duration::from_secs(30);

/// The one Lease object, as the API server would store it.
#[derive(Default)]
struct LeaseStore {
    spec: Option<Map<String, Value>>,
    resource_version: u64,
}

impl LeaseStore {
    fn object(&self) -> Value {
        json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": LEASE,
                "namespace": NAMESPACE,
                "resourceVersion": self.resource_version.to_string(),
            },
            "spec": self.spec.clone().unwrap_or_default(),
        })
    }

    fn holder(&self) -> Option<String> {
        self.spec
            .as_ref()?
            .get("holderIdentity")?
            .as_str()
            .map(str::to_string)
    }

    /// Merges `patch.spec` in; a null removes a field.
    fn merge(&mut self, patch: &Value) {
        let spec = self.spec.get_or_insert_with(Map::new);
        if let Some(fields) = patch["spec"].as_object() {
            for (key, value) in fields {
                if value.is_null() {
                    spec.remove(key);
                } else {
                    spec.insert(key.clone(), value.clone());
                }
            }
        }
        self.resource_version += 1;
    }
}

/// One replica's view of the API server; `cut_off` makes every request fail.
struct Replica {
    client: Client,
    cut_off: Arc<AtomicBool>,
}

fn replica(store: &Arc<Mutex<LeaseStore>>) -> Replica {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<ResponseBody>>();
    let cut_off = Arc::new(AtomicBool::new(false));
    let store = store.clone();
    let partitioned = cut_off.clone();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let response = if partitioned.load(Ordering::SeqCst) {
                respond(
                    StatusCode::SERVICE_UNAVAILABLE,
                    json!({"kind": "Status", "status": "Failure", "code": 503, "reason": "ServiceUnavailable"}),
                )
            } else {
                answer(&store, request).await
            };
            send.send_response(response);
        }
    });
    Replica {
        client: Client::new(service, NAMESPACE),
        cut_off,
    }
}

async fn answer(store: &Mutex<LeaseStore>, request: Request<Body>) -> Response<ResponseBody> {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or_default().to_string();
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .expect("request body readable");
    let body: Value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("request body is JSON")
    };
    let leases = format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases");
    let lease = format!("{leases}/{LEASE}");
    let mut store = store.lock().unwrap_or_else(PoisonError::into_inner);
    let watch = query.split('&').any(|pair| pair == "watch=true");
    match (method, path) {
        // A follower's watch of the Lease: this store streams no events
        // (the hand-over test below uses support::cluster, which does).
        (Method::GET, p) if p == leases && watch => Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(ResponseBody::from_stream(futures::stream::pending::<
                Result<bytes::Bytes, std::io::Error>,
            >()))
            .expect("response builds"),
        (Method::GET, p) if p == leases => respond(
            StatusCode::OK,
            json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "LeaseList",
                "metadata": {"resourceVersion": store.resource_version.to_string()},
                "items": store.spec.is_some().then(|| store.object()).into_iter().collect::<Vec<_>>(),
            }),
        ),
        (Method::GET, p) if p == lease => match store.spec {
            Some(_) => respond(StatusCode::OK, store.object()),
            None => respond(
                StatusCode::NOT_FOUND,
                json!({"kind": "Status", "status": "Failure", "code": 404, "reason": "NotFound"}),
            ),
        },
        (Method::POST, p) if p == leases => {
            if store.spec.is_some() {
                respond(
                    StatusCode::CONFLICT,
                    json!({"kind": "Status", "status": "Failure", "code": 409, "reason": "AlreadyExists"}),
                )
            } else {
                store.spec = Some(Map::new());
                store.resource_version += 1;
                respond(StatusCode::CREATED, store.object())
            }
        }
        (Method::PATCH, p) if p == lease => {
            let claimant = body["spec"]["holderIdentity"].as_str().map(str::to_string);
            let held_by_other =
                matches!((store.holder(), &claimant), (Some(h), Some(c)) if &h != c);
            // A server-side apply of holderIdentity conflicts with the field
            // manager that set it, as the real API server does.
            if content_type.starts_with("application/apply-patch") && held_by_other {
                return respond(
                    StatusCode::CONFLICT,
                    json!({"kind": "Status", "status": "Failure", "code": 409, "reason": "Conflict"}),
                );
            }
            store.merge(&body);
            respond(StatusCode::OK, store.object())
        }
        (method, path) => panic!("the fake API server does not expect {method} {path}"),
    }
}

fn respond(code: StatusCode, body: Value) -> Response<ResponseBody> {
    Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(ResponseBody::from(
            serde_json::to_vec(&body).expect("serializes"),
        ))
        .expect("response builds")
}

fn settings(identity: &str) -> LeaseSettings {
    LeaseSettings {
        name: LEASE.into(),
        namespace: NAMESPACE.into(),
        identity: identity.into(),
        duration_seconds: 2,
        grace_seconds: 1,
    }
}

/// Polls `condition` until it holds or the deadline passes.
async fn eventually(what: &str, condition: impl Fn() -> bool) {
    support::poll_until(what, DEADLINE, condition).await;
}

/// One replica's lease task, running until [`LeaseTask::stop`].
struct LeaseTask {
    leadership: Leadership,
    stop: shutdown::Trigger,
    task: tokio::task::JoinHandle<Result<(), genswap_controller::leader::LeaseError>>,
}

impl LeaseTask {
    fn start(client: Client, settings: LeaseSettings) -> LeaseTask {
        let leadership = Leadership::follower(Arc::new(Metrics::new()));
        let (stop, stopped) = shutdown::channel();
        let task = tokio::spawn(hold_lease(
            client.clone(),
            client,
            settings,
            leadership.clone(),
            stopped.wait(),
        ));
        LeaseTask {
            leadership,
            stop,
            task,
        }
    }

    /// Shuts it down and waits for a clean end.
    async fn stop(self) {
        self.stop.fire();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the replica stops in time")
            .expect("task joined")
            .expect("lease task ended cleanly");
    }
}

#[tokio::test]
async fn one_leader_steps_down_when_cut_off_and_the_other_takes_over() {
    let store = Arc::new(Mutex::new(LeaseStore::default()));
    let a = replica(&store);
    let task_a = LeaseTask::start(a.client.clone(), settings("replica-a"));
    let leader_a = task_a.leadership.clone();
    eventually("replica-a leads alone", || leader_a.is_leader()).await;

    let b = replica(&store);
    let task_b = LeaseTask::start(b.client.clone(), settings("replica-b"));
    let leader_b = task_b.leadership.clone();

    // A is cut off from the API server: its next renewal fails and it
    // steps down; B then finds the claim expired and takes it.
    a.cut_off.store(true, Ordering::SeqCst);
    eventually("replica-a steps down", || !leader_a.is_leader()).await;
    eventually("replica-b takes over", || leader_b.is_leader()).await;
    assert_eq!(
        store
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .holder()
            .as_deref(),
        Some("replica-b")
    );
    assert!(!leader_a.is_leader(), "a cut-off replica stays a follower");

    // B shuts down: it steps down and frees the Lease for A.
    task_b.stop().await;
    assert!(!leader_b.is_leader());
    assert_eq!(
        store
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .holder(),
        None,
        "shutdown released the Lease"
    );

    // A reaches the API server again and leads.
    a.cut_off.store(false, Ordering::SeqCst);
    eventually("replica-a leads again", || leader_a.is_leader()).await;
    task_a.stop().await;
}

/// Long enough that waiting for expiry could not pass for a hand-over.
const LONG_LEASE_SECONDS: u64 = 60;
/// A generous bound for the graceful hand-over (whose goal is 2 s), far
/// below the lease duration a follower would otherwise wait out.
const HAND_OVER_DEADLINE: Duration = Duration::from_secs(10);

#[tokio::test]
async fn a_released_lease_is_taken_by_the_follower_without_waiting_for_expiry() {
    use support::cluster::{Kind, client, lock};
    let cluster = support::cluster::seeded();
    let long = |identity: &str| LeaseSettings {
        name: support::cluster::LEASE.into(),
        namespace: support::cluster::NS.into(),
        identity: identity.into(),
        duration_seconds: LONG_LEASE_SECONDS,
        grace_seconds: 20,
    };
    let task_a = LeaseTask::start(client(&cluster), long("replica-a"));
    let leader_a = task_a.leadership.clone();
    eventually("replica-a leads", || leader_a.is_leader()).await;

    let task_b = LeaseTask::start(client(&cluster), long("replica-b"));
    let leader_b = task_b.leadership.clone();
    // Both watch the Lease once their managers have read it: B now waits,
    // as a follower, for a claim that runs LONG_LEASE_SECONDS.
    eventually("both replicas watch the Lease", || {
        lock(&cluster).open_watches(Kind::Lease) == 2
    })
    .await;
    assert!(!leader_b.is_leader());

    // A shuts down gracefully: it steps down and releases the Lease.
    let released = tokio::time::Instant::now();
    task_a.stop().await;
    support::poll_until("replica-b takes over", HAND_OVER_DEADLINE, || {
        leader_b.is_leader()
    })
    .await;
    let hand_over = released.elapsed();
    eprintln!("graceful hand-over: replica-b led {hand_over:?} after replica-a's shutdown began");
    assert_eq!(lock(&cluster).lease_holder().as_deref(), Some("replica-b"));
    assert!(!leader_a.is_leader());

    task_b.stop().await;
}
