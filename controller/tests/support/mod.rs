//! Shared fixtures of the adapter tests: objects, a context over a mocked
//! API server, and an `ApiServerVerifier` that states the exact requests a
//! reconcile must send, in order, asserts them and answers them.
#![allow(dead_code)] // each test binary uses its own subset

pub mod cluster;
pub mod fake_api;
mod poll;

pub use poll::poll_until;

use std::sync::Arc;
use std::time::Duration;

use genswap_controller::attempt_index::AttemptIndex;
use genswap_controller::cache_sync::CacheSync;
use genswap_controller::context::FIELD_MANAGER;
use genswap_controller::context::{Context, Planner};
use genswap_controller::events::EventQueue;
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use genswap_controller::observe::WatchedIg;
use genswap_core::scheduler::{Plan, PlanEvent, RecordWrite};
use genswap_crds::{InstanceGeneration, InstanceGenerationStatus, SwapAttempt};
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::client::Body;
use kube::core::DeserializeGuard;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::{self, store::Writer};
use kube::runtime::watcher;
use serde_json::{Value, json};

pub const NAMESPACE: &str = "apps";
pub const IG_NAME: &str = "web";
pub const IG_UID: &str = "0f6c5a4e-0000-4000-8000-000000000001";
pub const SHA: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
/// Every request of a test must arrive within this; generous on purpose.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// An InstanceGeneration as the cache holds it.
pub fn ig(resource_version: &str, status: Option<InstanceGenerationStatus>) -> InstanceGeneration {
    let mut ig: InstanceGeneration = serde_json::from_value(json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "InstanceGeneration",
        "metadata": {
            "name": IG_NAME,
            "namespace": NAMESPACE,
            "uid": IG_UID,
            "resourceVersion": resource_version,
            "generation": 1,
        },
        "spec": {
            "build": { "id": "b1", "artifact": { "path": "/opt/web/b1" }, "sha256": SHA },
        },
    }))
    .expect("fixture IG deserializes");
    ig.status = status;
    ig
}

/// A status with `sched_rev` and nothing else.
pub fn status(sched_rev: i64) -> InstanceGenerationStatus {
    InstanceGenerationStatus {
        sched_rev,
        ready: Some(format!("0/{sched_rev}")),
        ..InstanceGenerationStatus::default()
    }
}

/// A SwapAttempt owned by the fixture IG.
pub fn attempt(node: &str, sched_rev: i64) -> SwapAttempt {
    serde_json::from_value(json!({
        "apiVersion": "genswap.dev/v1alpha1",
        "kind": "SwapAttempt",
        "metadata": {
            "name": format!("{IG_NAME}-{node}-{sched_rev}"),
            "namespace": NAMESPACE,
            "labels": { "genswap.dev/instance": IG_NAME },
            "ownerReferences": [{
                "apiVersion": "genswap.dev/v1alpha1",
                "kind": "InstanceGeneration",
                "name": IG_NAME,
                "uid": IG_UID,
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "instance": IG_NAME,
            "nodeName": node,
            "schedRev": sched_rev,
            "cause": "install",
            "build": { "id": "b1", "artifact": { "path": "/opt/web/b1" }, "sha256": SHA },
            "mode": "overlap",
        },
    }))
    .expect("fixture attempt deserializes")
}

/// A Node with labels.
pub fn node(name: &str, labels: &[(&str, &str)]) -> Node {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name, "labels": labels },
    }))
    .expect("fixture node deserializes")
}

pub fn event(warning: bool, reason: &str, message: &str) -> PlanEvent {
    PlanEvent {
        warning,
        reason: reason.into(),
        message: message.into(),
    }
}

/// The one instant every test plans at.
pub fn fixed_now() -> Timestamp {
    Timestamp::from_second(1_750_000_000).expect("valid timestamp")
}

/// A planner that always returns `plan`, whatever it is given.
pub fn fixed_planner(plan: Plan) -> Planner {
    Arc::new(move |_, _, _, _, _| plan.clone())
}

/// The controller and replica every harness writes Events as.
pub fn reporter() -> Reporter {
    Reporter {
        controller: "genswap-controller".into(),
        instance: Some("test-replica".into()),
    }
}

/// A context over a mocked API server, with caches the test fills.
pub struct Harness {
    pub ctx: Arc<Context>,
    pub metrics: Arc<Metrics>,
    pub leadership: Leadership,
    pub attempts: AttemptIndex,
    pub nodes: Writer<Node>,
}

/// A context over a mocked API server, and that server's side. The test
/// fills the caches itself, so they count as synced.
pub fn harness(planner: Planner, leader: bool) -> (Harness, ApiServerVerifier) {
    harness_with_caches(planner, leader, CacheSync::all_marked())
}

/// [`harness`] with the test in charge of which caches have synced.
pub fn harness_with_caches(
    planner: Planner,
    leader: bool,
    caches: CacheSync,
) -> (Harness, ApiServerVerifier) {
    harness_with_patience(
        planner,
        leader,
        caches,
        genswap_controller::expectations::PATIENCE,
    )
}

/// [`harness_with_caches`] whose expectations lapse after `patience`.
pub fn harness_with_patience(
    planner: Planner,
    leader: bool,
    caches: CacheSync,
    patience: Duration,
) -> (Harness, ApiServerVerifier) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, NAMESPACE);
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    leadership.set(leader);
    let attempts = AttemptIndex::new();
    let (node_store, nodes) = reflector::store();
    // Each Event alone and at once, so a scenario can list them in order;
    // adapter_events.rs tests the folding.
    let (events, _sender) = EventQueue::start(
        client.clone(),
        reporter(),
        leadership.clone(),
        metrics.clone(),
        Duration::ZERO,
    );
    let ctx = Context::new(
        client,
        metrics.clone(),
        leadership.clone(),
        events,
        attempts.clone(),
        node_store,
        caches,
    )
    .with_planner(planner)
    .with_clock(Arc::new(fixed_now))
    .with_patience(patience);
    let harness = Harness {
        ctx: Arc::new(ctx),
        metrics,
        leadership,
        attempts,
        nodes,
    };
    (harness, ApiServerVerifier(handle))
}

impl Harness {
    pub fn add_attempt(&mut self, attempt: SwapAttempt) {
        self.attempts
            .observe(&watcher::Event::Apply(DeserializeGuard(Ok(attempt))));
    }

    pub fn add_node(&mut self, node: Node) {
        self.nodes.apply_watcher_event(&watcher::Event::Apply(node));
    }
}

/// Wraps an IG the way the controller's watch delivers it.
pub fn watched(ig: InstanceGeneration) -> Arc<WatchedIg> {
    Arc::new(DeserializeGuard(Ok(ig)))
}

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// The mocked API server's side of the client.
pub struct ApiServerVerifier(Handle);

/// What the reconcile must send, request by request.
pub enum Scenario {
    /// The status reservation, every create, every delete, every Event, in
    /// that order, all accepted.
    Apply { ig: InstanceGeneration, plan: Plan },
    /// The status reservation, answered 409 Conflict; nothing after it.
    ReservationConflict { ig: InstanceGeneration, plan: Plan },
    /// The reservation, then the first create answered `code`, then the
    /// remaining creates, deletes and Events, then a Warning about the failed
    /// create.
    CreateFails {
        ig: InstanceGeneration,
        plan: Plan,
        code: StatusCode,
    },
    /// The reservation; while answering it, leadership is lost. Nothing else.
    LoseLeadershipDuringReservation {
        ig: InstanceGeneration,
        plan: Plan,
        leadership: Leadership,
    },
    /// Only the listed Events (no status write, no create, no delete).
    EventsOnly { events: Vec<PlanEvent> },
    /// Not a single request.
    RadioSilence,
    /// A metadata-only list of the attempts, answered in these pages, each
    /// but the last with a continue token the next request must carry.
    ListAttempts { pages: Vec<Vec<SwapAttempt>> },
    /// The same list of one IG's attempts (label `genswap.dev/instance=web`).
    ListAttemptsOfWeb { pages: Vec<Vec<SwapAttempt>> },
    /// The reservation and every create accepted; the first Event's POST is
    /// then held unanswered until `released` fires, and answered after.
    EventHeld {
        ig: InstanceGeneration,
        plan: Plan,
        released: tokio::sync::oneshot::Receiver<()>,
    },
}

impl ApiServerVerifier {
    /// Runs `scenario`, then requires that no further request arrives before
    /// every client is dropped. Await the handle (see [`finish`]) after
    /// dropping the context.
    pub fn run(self, scenario: Scenario) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let verifier = match scenario {
                Scenario::Apply { ig, plan } => {
                    let mut v = self;
                    for write in &plan.records {
                        v = v.record_patch(write).await;
                    }
                    let mut v = v.status_apply(&ig, &plan.status, Answer::Accept).await;
                    for attempt in &plan.create {
                        v = v.attempt_create(attempt, StatusCode::CREATED).await;
                    }
                    for name in &plan.delete {
                        v = v.attempt_delete(name).await;
                    }
                    for event in &plan.events {
                        v = v.event(event).await;
                    }
                    v
                }
                Scenario::ListAttempts { pages } => {
                    let mut v = self;
                    let last = pages.len().saturating_sub(1);
                    for (index, page) in pages.iter().enumerate() {
                        v = v
                            .attempt_list_page("genswap.dev%2Finstance", index, page, index < last)
                            .await;
                    }
                    v
                }
                Scenario::ListAttemptsOfWeb { pages } => {
                    let mut v = self;
                    let last = pages.len().saturating_sub(1);
                    for (index, page) in pages.iter().enumerate() {
                        v = v
                            .attempt_list_page(
                                "genswap.dev%2Finstance%3Dweb",
                                index,
                                page,
                                index < last,
                            )
                            .await;
                    }
                    v
                }
                Scenario::ReservationConflict { ig, plan } => {
                    self.status_apply(&ig, &plan.status, Answer::Conflict).await
                }
                Scenario::CreateFails { ig, plan, code } => {
                    let mut v = self.status_apply(&ig, &plan.status, Answer::Accept).await;
                    let (first, rest) = plan.create.split_first().expect("a create to fail");
                    v = v.attempt_create(first, code).await;
                    for attempt in rest {
                        v = v.attempt_create(attempt, StatusCode::CREATED).await;
                    }
                    for name in &plan.delete {
                        v = v.attempt_delete(name).await;
                    }
                    for event in &plan.events {
                        v = v.event(event).await;
                    }
                    v.event_with_reason(
                        true,
                        "AttemptCreateFailed",
                        &first.metadata.name.clone().unwrap_or_default(),
                    )
                    .await
                }
                Scenario::LoseLeadershipDuringReservation {
                    ig,
                    plan,
                    leadership,
                } => {
                    self.status_apply(&ig, &plan.status, Answer::AcceptAndStepDown(leadership))
                        .await
                }
                Scenario::EventsOnly { events } => {
                    let mut v = self;
                    for event in &events {
                        v = v.event(event).await;
                    }
                    v
                }
                Scenario::RadioSilence => self,
                Scenario::EventHeld { ig, plan, released } => {
                    let mut v = self.status_apply(&ig, &plan.status, Answer::Accept).await;
                    for attempt in &plan.create {
                        v = v.attempt_create(attempt, StatusCode::CREATED).await;
                    }
                    let (request, send) = v.next().await;
                    assert_eq!(
                        request.uri().path(),
                        format!("/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events")
                    );
                    let _ = released.await;
                    send.send_response(
                        Response::builder()
                            .status(StatusCode::CREATED)
                            .body(Body::from(
                                serde_json::to_vec(&json!({})).unwrap_or_default(),
                            ))
                            .expect("a response"),
                    );
                    v
                }
            };
            verifier.no_more_requests().await;
        })
    }

    async fn next(
        &mut self,
    ) -> (
        Request<Body>,
        tower_test::mock::SendResponse<Response<Body>>,
    ) {
        tokio::time::timeout(DEADLINE, self.0.next_request())
            .await
            .expect("the reconcile sent the next request in time")
            .expect("the reconcile sent another request")
    }

    async fn no_more_requests(mut self) {
        let next = tokio::time::timeout(DEADLINE, self.0.next_request())
            .await
            .expect("the client was dropped in time (drop the context before finish)");
        if let Some((request, _)) = next {
            panic!(
                "unexpected request after the scenario: {} {}",
                request.method(),
                request.uri()
            );
        }
    }

    async fn status_apply(
        mut self,
        ig: &InstanceGeneration,
        expected: &InstanceGenerationStatus,
        answer: Answer,
    ) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(
            request.method(),
            Method::PATCH,
            "status is written by a PATCH"
        );
        assert_eq!(
            request.uri().path(),
            format!(
                "/apis/genswap.dev/v1alpha1/namespaces/{NAMESPACE}/instancegenerations/{IG_NAME}/status"
            ),
            "status goes to the /status subresource"
        );
        let query = query_pairs(&request);
        assert!(
            query.contains(&("fieldManager".into(), FIELD_MANAGER.into())),
            "field manager in the query: {query:?}"
        );
        assert!(
            query.contains(&("force".into(), "true".into())),
            "forced apply: {query:?}"
        );
        assert_eq!(
            request
                .headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            Some("application/apply-patch+yaml"),
            "server-side apply"
        );
        let body = body_json(request).await;
        assert_eq!(body["apiVersion"], "genswap.dev/v1alpha1");
        assert_eq!(body["kind"], "InstanceGeneration");
        assert_eq!(body["metadata"]["name"], IG_NAME);
        assert_eq!(
            body["metadata"]["resourceVersion"],
            ig.metadata
                .resource_version
                .clone()
                .expect("fixture has a resourceVersion"),
            "the reservation is conditional on the resourceVersion the plan was made from"
        );
        assert_eq!(
            body["status"]["schedRev"], expected.sched_rev,
            "the reserved schedRev is in the body"
        );
        let sent: InstanceGenerationStatus =
            serde_json::from_value(body["status"].clone()).expect("status deserializes");
        assert_eq!(&sent, expected, "the whole planned status is applied");
        match answer {
            Answer::Accept | Answer::AcceptAndStepDown(_) => {
                if let Answer::AcceptAndStepDown(leadership) = &answer {
                    leadership.set(false);
                }
                let mut written = ig.clone();
                written.status = Some(expected.clone());
                send.send_response(json_response(StatusCode::OK, &written));
            }
            Answer::Conflict => send.send_response(json_response(
                StatusCode::CONFLICT,
                &status_failure(
                    409,
                    "Conflict",
                    "Operation cannot be fulfilled on instancegenerations.genswap.dev \"web\": the object has been modified; please apply your changes to the latest version and try again",
                ),
            )),
        }
        self
    }

    async fn attempt_list_page(
        mut self,
        selector: &str,
        index: usize,
        page: &[SwapAttempt],
        more: bool,
    ) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::GET);
        assert_eq!(
            request.uri().path(),
            format!("/apis/genswap.dev/v1alpha1/namespaces/{NAMESPACE}/swapattempts")
        );
        let accept = request
            .headers()
            .get(http::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert!(
            accept.contains("as=PartialObjectMetadataList"),
            "metadata only: {accept}"
        );
        let query = query_pairs(&request);
        assert!(
            query.contains(&("labelSelector".into(), selector.into())),
            "{query:?}"
        );
        assert!(query.contains(&("limit".into(), "500".into())), "{query:?}");
        let token = query
            .iter()
            .find(|(k, _)| k == "continue")
            .map(|(_, v)| v.clone());
        assert_eq!(
            token,
            (index > 0).then(|| format!("page-{index}")),
            "page {index} carries the token of the one before"
        );
        assert!(
            !query.iter().any(|(k, _)| k == "resourceVersion"),
            "a quorum read: {query:?}"
        );
        let items: Vec<serde_json::Value> = page
            .iter()
            .map(|attempt| {
                json!({
                    "apiVersion": "meta.k8s.io/v1",
                    "kind": "PartialObjectMetadata",
                    "metadata": attempt.metadata,
                })
            })
            .collect();
        let mut metadata = json!({"resourceVersion": "900"});
        if more {
            metadata["continue"] = json!(format!("page-{}", index + 1));
        }
        send.send_response(json_response(
            StatusCode::OK,
            &json!({
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadataList",
                "metadata": metadata,
                "items": items,
            }),
        ));
        self
    }

    async fn attempt_create(mut self, attempt: &SwapAttempt, code: StatusCode) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(
            request.method(),
            Method::POST,
            "attempts are created by a POST"
        );
        assert_eq!(
            request.uri().path(),
            format!("/apis/genswap.dev/v1alpha1/namespaces/{NAMESPACE}/swapattempts")
        );
        let query = query_pairs(&request);
        assert!(
            query.contains(&("fieldManager".into(), FIELD_MANAGER.into())),
            "the create names the controller's field manager: {query:?}"
        );
        let body = body_json(request).await;
        assert_eq!(
            body["metadata"]["name"],
            attempt.metadata.name.clone().unwrap_or_default()
        );
        assert_eq!(body["spec"]["schedRev"], attempt.spec.sched_rev);
        assert_eq!(body["spec"]["nodeName"], attempt.spec.node_name);
        if code.is_success() {
            send.send_response(json_response(code, &body));
        } else {
            send.send_response(json_response(
                code,
                &status_failure(code.as_u16(), "InternalError", "etcd is having a bad day"),
            ));
        }
        self
    }

    async fn record_patch(mut self, write: &RecordWrite) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::PATCH, "a record is patched on");
        assert_eq!(
            request.uri().path(),
            format!(
                "/apis/genswap.dev/v1alpha1/namespaces/{NAMESPACE}/swapattempts/{}",
                write.attempt
            )
        );
        assert_eq!(
            request
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("application/merge-patch+json")
        );
        let body = body_json(request).await;
        assert_eq!(
            body,
            json!({"metadata": {"annotations": {"genswap.dev/record": write.record.to_annotation()}}}),
            "the patch sets the record and nothing else"
        );
        send.send_response(json_response(StatusCode::OK, &body));
        self
    }

    async fn attempt_delete(mut self, name: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::DELETE, "old attempts are deleted");
        assert_eq!(
            request.uri().path(),
            format!("/apis/genswap.dev/v1alpha1/namespaces/{NAMESPACE}/swapattempts/{name}")
        );
        send.send_response(json_response(
            StatusCode::OK,
            &json!({"apiVersion": "v1", "kind": "Status", "status": "Success"}),
        ));
        self
    }

    async fn event(self, event: &PlanEvent) -> Self {
        self.event_with_reason(event.warning, &event.reason, &event.message)
            .await
    }

    /// An Event on the IG with `reason`, whose note contains `note_part`.
    async fn event_with_reason(mut self, warning: bool, reason: &str, note_part: &str) -> Self {
        let (request, send) = self.next().await;
        assert_eq!(request.method(), Method::POST, "an Event is created");
        assert_eq!(
            request.uri().path(),
            format!("/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events")
        );
        let body = body_json(request).await;
        assert_eq!(body["reason"], reason);
        assert_eq!(body["type"], if warning { "Warning" } else { "Normal" });
        assert_eq!(body["regarding"]["kind"], "InstanceGeneration");
        assert_eq!(body["regarding"]["name"], IG_NAME);
        assert_eq!(body["regarding"]["uid"], IG_UID);
        assert_eq!(body["reportingController"], "genswap-controller");
        assert_eq!(body["reportingInstance"], "test-replica");
        let note = body["note"].as_str().unwrap_or_default();
        assert!(
            note.contains(note_part),
            "note {note:?} mentions {note_part:?}"
        );
        send.send_response(json_response(StatusCode::CREATED, &body));
        self
    }
}

enum Answer {
    Accept,
    AcceptAndStepDown(Leadership),
    Conflict,
}

/// Awaits a scenario; fails on a missing request, a wrong one or an extra one.
pub async fn finish(scenario: tokio::task::JoinHandle<()>) {
    tokio::time::timeout(DEADLINE * 3, scenario)
        .await
        .expect("the scenario finished in time")
        .expect("the scenario's assertions held");
}

fn query_pairs(request: &Request<Body>) -> Vec<(String, String)> {
    request
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            Some((key.to_string(), value.to_string()))
        })
        .collect()
}

async fn body_json(request: Request<Body>) -> Value {
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .expect("request body readable");
    serde_json::from_slice(&bytes).expect("request body is JSON")
}

fn json_response(code: StatusCode, body: &impl serde::Serialize) -> Response<Body> {
    Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            serde_json::to_vec(body).expect("response serializes"),
        ))
        .expect("response builds")
}

pub fn status_failure(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}
