//! The Event sender against a mocked API server: what it writes, when, and
//! as whom. Time is tokio's paused clock, so a window of ten seconds passes
//! as soon as nothing else is left to run; what is asserted about time is
//! that clock's, never the wall's.
//!
//! The mock accepts any body, where the API server validates an
//! events.k8s.io/v1 create (a series of one is refused, a note over 1 kB,
//! a missing eventTime...). [`assert_api_server_accepts`] holds every
//! Event written here to those rules, taken from the Kubernetes sources.

mod support;

use std::sync::Arc;
use std::time::Duration;

use genswap_controller::events::{EventQueue, EventSender, Queued};
use genswap_controller::leader::Leadership;
use genswap_controller::metrics::Metrics;
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::client::Body;
use kube::runtime::events::Reporter;
use serde_json::Value;
use support::{IG_NAME, IG_UID, NAMESPACE, reporter};
use tokio::time::Instant;

const WINDOW: Duration = Duration::from_secs(10);

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn regarding() -> ObjectReference {
    ObjectReference {
        api_version: Some("genswap.dev/v1alpha1".into()),
        kind: Some("InstanceGeneration".into()),
        name: Some(IG_NAME.into()),
        namespace: Some(NAMESPACE.into()),
        uid: Some(IG_UID.into()),
        ..ObjectReference::default()
    }
}

fn queued(warning: bool, reason: &str, note: &str) -> Queued {
    Queued {
        warning,
        reason: reason.into(),
        note: note.into(),
        regarding: regarding(),
    }
}

struct Sender {
    queue: EventQueue,
    sender: EventSender,
    leadership: Leadership,
    server: Handle,
}

fn start(window: Duration) -> Sender {
    start_as(window, reporter())
}

fn start_as(window: Duration, reporter: Reporter) -> Sender {
    let (service, server) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, NAMESPACE);
    let metrics = Arc::new(Metrics::new());
    let leadership = Leadership::follower(metrics.clone());
    leadership.set(true);
    let (queue, sender) = EventQueue::start(client, reporter, leadership.clone(), metrics, window);
    Sender {
        queue,
        sender,
        leadership,
        server,
    }
}

impl Sender {
    /// Drops the queue, waits for the sender to end and requires that it
    /// wrote nothing more.
    async fn close(self) {
        drop(self.queue);
        self.sender.finish(Duration::from_secs(60)).await;
        nothing_more(self.server).await;
    }
}

/// The next Event POST, answered 201, and the clock's time it came at.
async fn next_event(server: &mut Handle) -> (Value, Instant) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(600), server.next_request())
        .await
        .expect("an Event within ten minutes of the clock")
        .expect("the sender is still there");
    let arrived = Instant::now();
    assert_eq!(request.method(), Method::POST);
    assert_eq!(
        request.uri().path(),
        format!("/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events")
    );
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .expect("body readable");
    let body: Value = serde_json::from_slice(&bytes).expect("body is JSON");
    assert_api_server_accepts(&body);
    send.send_response(
        Response::builder()
            .status(StatusCode::CREATED)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(bytes.to_vec()))
            .expect("a response"),
    );
    (body, arrived)
}

/// Fails if a request arrives before the client is dropped.
async fn nothing_more(mut server: Handle) {
    let next = tokio::time::timeout(Duration::from_secs(600), server.next_request())
        .await
        .expect("the sender ended");
    if let Some((request, _)) = next {
        panic!("unexpected {} {}", request.method(), request.uri());
    }
}

/// What `ValidateEventCreate` (kubernetes pkg/apis/core/validation/
/// events.go) and the object meta checks demand of an events.k8s.io/v1
/// create, as far as this sender's Events can break it.
fn assert_api_server_accepts(event: &Value) {
    let text = |field: &str| {
        field
            .split('.')
            .fold(event, |v, k| &v[k])
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let name = text("metadata.name");
    assert!(
        is_dns_subdomain(&name),
        "metadata.name {name:?} is a DNS subdomain"
    );
    assert!(is_dns_subdomain(&text("metadata.namespace")), "{event}");
    assert!(
        !text("regarding.namespace").is_empty(),
        "a namespaced object is regarded: {event}"
    );
    assert!(
        !text("eventTime").is_empty(),
        "eventTime is required: {event}"
    );
    assert!(
        ["Normal", "Warning"].contains(&text("type").as_str()),
        "{event}"
    );
    for deprecated in [
        "deprecatedFirstTimestamp",
        "deprecatedLastTimestamp",
        "deprecatedCount",
        "deprecatedSource",
    ] {
        assert!(
            event.get(deprecated).is_none_or(Value::is_null),
            "{deprecated} must be unset: {event}"
        );
    }
    if let Some(series) = event.get("series").filter(|s| !s.is_null()) {
        assert!(
            series["count"].as_i64().is_some_and(|c| c >= 2),
            "series.count is at least 2: {event}"
        );
        assert!(
            series["lastObservedTime"]
                .as_str()
                .is_some_and(|t| !t.is_empty()),
            "{event}"
        );
    }
    let controller = text("reportingController");
    assert!(
        !controller.is_empty()
            && controller.len() <= 63
            && controller
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && controller.starts_with(|c: char| c.is_ascii_alphanumeric())
            && controller.ends_with(|c: char| c.is_ascii_alphanumeric()),
        "reportingController {controller:?} is a qualified name"
    );
    for (field, limit) in [("reportingInstance", 128), ("action", 128), ("reason", 128)] {
        let value = text(field);
        assert!(
            !value.is_empty() && value.len() <= limit,
            "{field} is 1..={limit} bytes: {value:?}"
        );
    }
    assert!(
        text("note").len() <= 1024,
        "note is at most 1024 bytes: {event}"
    );
}

fn is_dns_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn time(body: &Value, field: &str) -> Timestamp {
    let text = field
        .split('.')
        .fold(body, |value, key| &value[key])
        .as_str()
        .unwrap_or_else(|| panic!("{field} is set: {body}"));
    text.parse()
        .unwrap_or_else(|e| panic!("{field} {text:?} is a time: {e}"))
}

#[tokio::test(start_paused = true)]
async fn an_objects_normal_events_of_one_window_are_written_as_one_event() {
    let mut events = start(WINDOW);
    let opened = Instant::now();
    let queue = &events.queue;
    assert!(queue.record(queued(false, "AttemptIssued", "node n1: rev 1, canary")));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(queue.record(queued(false, "SwapDone", "node n1: rev 1 done")));
    assert!(queue.record(queued(false, "AttemptIssued", "node n2: rev 2")));

    let (event, arrived) = next_event(&mut events.server).await;
    assert!(
        arrived >= opened + WINDOW,
        "held for the window from the first: {:?}",
        arrived - opened
    );
    assert_eq!(event["apiVersion"], "events.k8s.io/v1");
    assert_eq!(event["kind"], "Event");
    assert!(
        event["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("web.")),
        "{event}"
    );
    assert_eq!(event["metadata"]["namespace"], NAMESPACE);
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["reason"], "Progressing");
    assert_eq!(event["action"], "Reconcile");
    assert_eq!(
        event["note"],
        "AttemptIssued: node n1: rev 1, canary; SwapDone: node n1: rev 1 done; AttemptIssued: node n2: rev 2"
    );
    assert_eq!(event["regarding"]["uid"], IG_UID);
    assert_eq!(event["regarding"]["kind"], "InstanceGeneration");
    assert_eq!(event["reportingController"], "genswap-controller");
    assert_eq!(event["reportingInstance"], "test-replica");
    assert_eq!(event["series"]["count"], 3);
    let first = time(&event, "eventTime");
    let last = time(&event, "series.lastObservedTime");
    // The stamps are the wall clock's; the paused clock does not move them.
    assert!(first <= last, "{first} then {last}");
    events.close().await;
}

#[tokio::test(start_paused = true)]
async fn a_warning_goes_at_once_after_the_normal_events_before_it() {
    let mut events = start(WINDOW);
    let opened = Instant::now();
    events
        .queue
        .record(queued(false, "AttemptIssued", "node n1: rev 1"));
    events
        .queue
        .record(queued(true, "SwapFailed", "node n1: rev 1 failed"));

    let (before, _) = next_event(&mut events.server).await;
    let (warning, arrived) = next_event(&mut events.server).await;
    assert!(
        arrived < opened + WINDOW,
        "not held: {:?}",
        arrived - opened
    );
    assert_eq!(
        (before["type"].clone(), before["reason"].clone()),
        ("Normal".into(), "AttemptIssued".into())
    );
    assert_eq!(before["note"], "node n1: rev 1");
    assert!(
        before.get("series").is_none_or(Value::is_null),
        "one entry is no series"
    );
    assert_eq!(
        (warning["type"].clone(), warning["reason"].clone()),
        ("Warning".into(), "SwapFailed".into())
    );
    events.close().await;
}

#[tokio::test(start_paused = true)]
async fn the_last_queue_handle_gone_writes_what_is_folding_at_once() {
    let Sender {
        queue,
        sender,
        mut server,
        ..
    } = start(WINDOW);
    let opened = Instant::now();
    queue.record(queued(false, "SwapDone", "node n1: done"));
    queue.record(queued(false, "SwapDone", "node n2: done"));
    drop(queue);
    let finished = tokio::spawn(sender.finish(Duration::from_secs(60)));

    let (event, arrived) = next_event(&mut server).await;
    assert!(
        arrived < opened + WINDOW,
        "not held: {:?}",
        arrived - opened
    );
    assert_eq!(event["reason"], "SwapDone");
    assert_eq!(event["note"], "node n1: done; node n2: done");
    assert_eq!(event["series"]["count"], 2);
    finished.await.expect("finish returns once all is written");
    nothing_more(server).await;
}

#[tokio::test(start_paused = true)]
async fn a_replica_that_stepped_down_writes_nothing_it_had_folded() {
    let events = start(WINDOW);
    events
        .queue
        .record(queued(false, "SwapDone", "node n1: done"));
    events.leadership.set(false);
    events.close().await;
}

#[tokio::test(start_paused = true)]
async fn an_identity_too_long_for_reporting_instance_is_cut_not_refused() {
    let mut events = start_as(
        Duration::ZERO,
        Reporter {
            controller: "genswap-controller".into(),
            instance: Some("r".repeat(200)),
        },
    );
    events
        .queue
        .record(queued(true, "SwapFailed", "node n1: failed"));
    let (event, _) = next_event(&mut events.server).await;
    assert_eq!(event["reportingInstance"], "r".repeat(128));
    events.close().await;
}
