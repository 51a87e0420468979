//! A tiny in-memory API server for one InstanceGeneration, its SwapAttempts
//! and Events, behind the mocked client: enough to run the real scheduler
//! through the adapter across failures and restarts.
//!
//! It keeps what a real API server guarantees the adapter relies on: the IG's
//! resourceVersion moves on every status write, and a status apply carrying
//! an older resourceVersion is refused with 409.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use genswap_crds::{InstanceGeneration, InstanceGenerationStatus, SwapAttempt};
use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::watcher;
use serde_json::{Value, json};

use super::{ApiServerVerifier, Harness, NAMESPACE, status_failure};

/// What the fake API server holds and saw.
#[derive(Debug)]
pub struct State {
    pub ig: InstanceGeneration,
    pub attempts: BTreeMap<String, SwapAttempt>,
    /// Event reasons, in the order recorded.
    pub event_reasons: Vec<String>,
    /// schedRev of every create received, accepted or not, in order.
    pub create_requests: Vec<i64>,
    /// How many of the next creates to refuse with 429.
    pub fail_next_creates: usize,
    /// Status writes refused for a stale resourceVersion.
    pub conflicts: usize,
    /// Status writes accepted.
    pub status_writes: usize,
    /// Node records written onto attempts.
    pub record_writes: usize,
    next_resource_version: u64,
}

/// A shared fake cluster; each controller incarnation serves from it.
#[derive(Clone, Debug)]
pub struct FakeCluster(Arc<Mutex<State>>);

impl FakeCluster {
    pub fn new(mut ig: InstanceGeneration) -> Self {
        ig.metadata.resource_version = Some("1".into());
        Self(Arc::new(Mutex::new(State {
            ig,
            attempts: BTreeMap::new(),
            event_reasons: Vec::new(),
            create_requests: Vec::new(),
            fail_next_creates: 0,
            conflicts: 0,
            status_writes: 0,
            record_writes: 0,
            next_resource_version: 2,
        })))
    }

    pub fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The IG as stored now.
    pub fn ig(&self) -> InstanceGeneration {
        self.with(|state| state.ig.clone())
    }

    /// Loads the harness's caches with what the cluster holds, as a relist
    /// would, and returns the IG as the controller's own cache would hold it.
    pub fn sync(&self, harness: &mut Harness) -> InstanceGeneration {
        let (ig, attempts) = self.with(|state| {
            (
                state.ig.clone(),
                state.attempts.values().cloned().collect::<Vec<_>>(),
            )
        });
        harness.attempts.observe(&watcher::Event::Init);
        for attempt in attempts {
            harness
                .attempts
                .observe(&watcher::Event::InitApply(DeserializeGuard(Ok(attempt))));
        }
        harness.attempts.observe(&watcher::Event::InitDone);
        ig
    }

    /// The agent's side: reports `outcome` on an attempt.
    pub fn report(&self, attempt: &str, outcome: &str, generation: i64) {
        self.with(|state| {
            let stored = state
                .attempts
                .get_mut(attempt)
                .unwrap_or_else(|| panic!("attempt {attempt} exists"));
            stored.status = Some(
                serde_json::from_value(json!({
                    "outcome": outcome,
                    "effectiveMode": "overlap",
                    "generation": generation,
                    "executed": true,
                }))
                .expect("attempt status deserializes"),
            );
        });
    }

    /// Answers the client behind `verifier` until every client is dropped.
    pub fn serve(&self, verifier: ApiServerVerifier) -> tokio::task::JoinHandle<()> {
        let cluster = self.clone();
        let mut handle = verifier.0;
        tokio::spawn(async move {
            while let Some((request, send)) = handle.next_request().await {
                let response = cluster.answer(request).await;
                send.send_response(response);
            }
        })
    }

    async fn answer(&self, request: Request<Body>) -> Response<Body> {
        let method = request.method().clone();
        let path = request.uri().path().to_string();
        let body: Value = {
            let bytes = request
                .into_body()
                .collect_bytes()
                .await
                .expect("request body readable");
            if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("request body is JSON")
            }
        };
        let igs = format!("/apis/genswap.dev/v1alpha1/namespaces/{NAMESPACE}/instancegenerations/");
        let attempts = format!("/apis/genswap.dev/v1alpha1/namespaces/{NAMESPACE}/swapattempts");
        let events = format!("/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events");
        self.with(|state| {
            if method == Method::PATCH && path.starts_with(&igs) && path.ends_with("/status") {
                state.apply_status(&body)
            } else if method == Method::POST && path == attempts {
                state.create_attempt(body)
            } else if method == Method::PATCH && path.starts_with(&attempts) {
                state.patch_record(path.rsplit('/').next().unwrap_or_default(), &body)
            } else if method == Method::DELETE && path.starts_with(&attempts) {
                let name = path.rsplit('/').next().unwrap_or_default();
                match state.attempts.remove(name) {
                    Some(_) => respond(
                        StatusCode::OK,
                        &json!({"kind": "Status", "status": "Success"}),
                    ),
                    None => respond(
                        StatusCode::NOT_FOUND,
                        &status_failure(404, "NotFound", name),
                    ),
                }
            } else if method == Method::POST && path == events {
                state
                    .event_reasons
                    .push(body["reason"].as_str().unwrap_or_default().to_string());
                respond(StatusCode::CREATED, &body)
            } else {
                panic!("the fake API server does not expect {method} {path}");
            }
        })
    }
}

impl State {
    fn apply_status(&mut self, body: &Value) -> Response<Body> {
        let current = self
            .ig
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default();
        if body["metadata"]["resourceVersion"].as_str() != Some(current.as_str()) {
            self.conflicts += 1;
            return respond(
                StatusCode::CONFLICT,
                &status_failure(409, "Conflict", "the object has been modified"),
            );
        }
        let status: InstanceGenerationStatus =
            serde_json::from_value(body["status"].clone()).expect("applied status deserializes");
        self.ig.status = Some(status);
        self.status_writes += 1;
        self.ig.metadata.resource_version = Some(self.next_resource_version.to_string());
        self.next_resource_version += 1;
        respond(StatusCode::OK, &self.ig)
    }

    /// The node record: a merge patch of the annotations alone.
    fn patch_record(&mut self, name: &str, body: &Value) -> Response<Body> {
        let Some(attempt) = self.attempts.get_mut(name) else {
            return respond(
                StatusCode::NOT_FOUND,
                &status_failure(404, "NotFound", name),
            );
        };
        let patched: BTreeMap<String, String> =
            serde_json::from_value(body["metadata"]["annotations"].clone())
                .expect("an attempt patch sets annotations and nothing else");
        attempt
            .metadata
            .annotations
            .get_or_insert_default()
            .extend(patched);
        self.record_writes += 1;
        respond(StatusCode::OK, &*attempt)
    }

    fn create_attempt(&mut self, body: Value) -> Response<Body> {
        let mut attempt: SwapAttempt =
            serde_json::from_value(body).expect("created attempt deserializes");
        self.create_requests.push(attempt.spec.sched_rev);
        if self.fail_next_creates > 0 {
            self.fail_next_creates -= 1;
            // A refusal, so nothing was stored: a 5xx would leave that
            // unknown, and the controller would wait for its cache instead
            // (adapter_reconcile.rs).
            return respond(
                StatusCode::TOO_MANY_REQUESTS,
                &status_failure(
                    429,
                    "TooManyRequests",
                    "the server has received too many requests and has asked us to try again later",
                ),
            );
        }
        let name = attempt.metadata.name.clone().unwrap_or_default();
        if self.attempts.contains_key(&name) {
            return respond(
                StatusCode::CONFLICT,
                &status_failure(409, "AlreadyExists", &name),
            );
        }
        attempt.metadata.resource_version = Some(self.next_resource_version.to_string());
        self.next_resource_version += 1;
        self.attempts.insert(name, attempt.clone());
        respond(StatusCode::CREATED, &attempt)
    }
}

fn respond(code: StatusCode, body: &impl serde::Serialize) -> Response<Body> {
    Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            serde_json::to_vec(body).expect("response serializes"),
        ))
        .expect("response builds")
}
