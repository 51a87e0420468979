//! Outcome reports against a mocked API server and a real journal in a temp
//! dir: the server-side apply of `/status` carries every outcome field and
//! the conditions; a failed write is retried until accepted and only then
//! acknowledged in the journal; a 404 drops it.

mod kube_support;

use std::sync::Arc;
use std::time::Duration;

use genswap_crds::{Cause, InstanceKind, Mode, Outcome, StepTiming};
use http::{Method, StatusCode};
use kube_support::{GROUP_PATH, NAMESPACE, condition, mock_client};
use node_agent::engine::Cancel;
use node_agent::gate::InstanceKey;
use node_agent::journal::{AttemptRef, Journal, OutcomeRecord, Record};
use node_agent::kube::report::{Delivered, OutcomeReport, Reporter};
use node_agent::kube::{FIELD_MANAGER, ReportBackoff};
use node_agent::metrics::AgentMetrics;
use serde_json::json;

const NAME: &str = "web-node-a-3";
/// 2025-06-15T15:06:40Z and 1.5 s later (API times have whole seconds).
const STARTED_MS: i64 = 1_750_000_000_000;
const FINISHED_MS: i64 = 1_750_000_001_500;

fn instance() -> InstanceKey {
    InstanceKey::new(NAMESPACE, "web").expect("instance key")
}

/// A real journal in a temp dir holding one finished, unacknowledged outcome.
fn journal_with(outcome: OutcomeRecord) -> (tempfile::TempDir, Arc<Journal>, OutcomeReport) {
    let dir = tempfile::tempdir().expect("temp dir");
    let journal = Arc::new(Journal::open(dir.path()).expect("journal"));
    let mut record = Record::admitted(
        instance(),
        AttemptRef {
            name: NAME.into(),
            uid: None,
            sched_rev: 3,
        },
        Cause::Release,
        InstanceKind::Instance,
        Mode::Overlap,
        outcome.effective_mode,
    );
    record.finish(outcome);
    journal.record(&record).expect("journal the outcome");
    let report = OutcomeReport::from_record(&record).expect("a finished record");
    (dir, journal, report)
}

fn done() -> OutcomeRecord {
    OutcomeRecord {
        outcome: Outcome::Done,
        effective_mode: Mode::Overlap,
        generation: Some(2),
        reason: String::new(),
        executed: true,
        clean_exit: false,
        drain_ms: Some(120),
        listener_handover: None,
        steps: vec![
            StepTiming {
                step: "stage".into(),
                result: "ok".into(),
                millis: 40,
            },
            StepTiming {
                step: "switch".into(),
                result: "ok".into(),
                millis: 1,
            },
        ],
        started_at_ms: STARTED_MS,
        finished_at_ms: FINISHED_MS,
    }
}

fn pending(journal: &Journal) -> Vec<i64> {
    journal
        .pending_reports()
        .expect("read the journal")
        .iter()
        .map(|r| r.attempt.sched_rev)
        .collect()
}

fn fast_backoff() -> ReportBackoff {
    ReportBackoff {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(40),
    }
}

fn reporter(client: kube::Client, journal: Arc<Journal>) -> (Reporter, Arc<AgentMetrics>) {
    let metrics = Arc::new(AgentMetrics::new());
    (
        Reporter::new(client, journal, fast_backoff(), metrics.clone()),
        metrics,
    )
}

fn accepted_object() -> serde_json::Value {
    kube_support::attempt_object(NAMESPACE, NAME, &kube_support::plain_spec("web", 3), None)
}

#[tokio::test]
async fn status_apply_carries_every_outcome_field_and_the_conditions() {
    let (_dir, journal, report) = journal_with(done());
    let (client, mut server) = mock_client();
    let (reporter, _) = reporter(client, journal.clone());
    let delivery = tokio::spawn(async move { reporter.deliver(&report).await });

    let write = server.expect_status_patch(NAMESPACE, NAME).await;
    let request = write.request.clone();
    assert_eq!(request.method, Method::PATCH);
    assert_eq!(
        request.path,
        format!("{GROUP_PATH}/namespaces/{NAMESPACE}/swapattempts/{NAME}/status")
    );
    assert_eq!(
        request.query.get("fieldManager").map(String::as_str),
        Some(FIELD_MANAGER)
    );
    assert_eq!(request.query.get("force").map(String::as_str), Some("true"));
    assert_eq!(
        request.content_type.as_deref(),
        Some("application/apply-patch+yaml")
    );
    assert_eq!(request.body["apiVersion"], "genswap.dev/v1alpha1");
    assert_eq!(request.body["kind"], "SwapAttempt");
    let status = &request.body["status"];
    assert_eq!(status["outcome"], "done");
    assert_eq!(status["effectiveMode"], "overlap");
    assert_eq!(status["generation"], 2);
    assert_eq!(status["executed"], true);
    assert!(
        status.get("cleanExit").is_none(),
        "said only when true: {status:#}"
    );
    assert_eq!(status["drainMs"], 120);
    assert_eq!(status["startedAt"], "2025-06-15T15:06:40Z");
    assert_eq!(status["finishedAt"], "2025-06-15T15:06:41Z");
    assert_eq!(
        status["steps"],
        json!([
            { "step": "stage", "result": "ok", "millis": 40 },
            { "step": "switch", "result": "ok", "millis": 1 },
        ])
    );
    assert!(
        status.get("reason").is_none(),
        "no reason on a plain done: {status:#}"
    );
    let ready = condition(status, "Ready");
    assert_eq!(
        (ready["status"].as_str(), ready["reason"].as_str()),
        (Some("True"), Some("Done"))
    );
    assert_eq!(ready["message"], "the successor serves");
    assert_eq!(
        ready["observedGeneration"],
        serde_json::Value::Null,
        "unknown to the journal"
    );
    assert_eq!(ready["lastTransitionTime"], "2025-06-15T15:06:41Z");
    assert_eq!(condition(status, "Stalled")["status"], "False");
    assert_eq!(condition(status, "Reconciling")["status"], "False");
    assert_eq!(
        pending(&journal),
        vec![3],
        "kept until the server accepts it"
    );

    write.respond_json(StatusCode::OK, &accepted_object());
    let delivered = tokio::time::timeout(kube_support::DEADLINE, delivery)
        .await
        .expect("delivered in time")
        .expect("delivery task");
    assert_eq!(delivered, Delivered::Accepted);
    assert_eq!(pending(&journal), Vec::<i64>::new(), "acknowledged");
    assert!(server.remaining().await.is_empty(), "one write only");
}

#[tokio::test]
async fn a_failed_build_is_stalled_with_its_reason() {
    let outcome = OutcomeRecord {
        outcome: Outcome::Down,
        effective_mode: Mode::Hold,
        reason: "health: no answer below 500 within 20s".into(),
        drain_ms: None,
        ..done()
    };
    let (_dir, journal, report) = journal_with(outcome);
    let (client, mut server) = mock_client();
    let (reporter, _) = reporter(client, journal.clone());
    let delivery = tokio::spawn(async move { reporter.deliver(&report).await });

    let write = server.expect_status_patch(NAMESPACE, NAME).await;
    let status = write.request.body["status"].clone();
    assert_eq!(status["outcome"], "down");
    assert_eq!(status["effectiveMode"], "hold");
    assert_eq!(status["reason"], "health: no answer below 500 within 20s");
    assert!(status.get("drainMs").is_none(), "{status:#}");
    let stalled = condition(&status, "Stalled");
    assert_eq!(
        (stalled["status"].as_str(), stalled["reason"].as_str()),
        (Some("True"), Some("Down"))
    );
    assert_eq!(stalled["message"], "health: no answer below 500 within 20s");
    assert_eq!(condition(&status, "Ready")["status"], "False");
    assert_eq!(condition(&status, "Reconciling")["status"], "False");
    write.respond_json(StatusCode::OK, &accepted_object());
    assert_eq!(delivery.await.expect("delivery task"), Delivered::Accepted);
    assert!(server.remaining().await.is_empty());
}

#[tokio::test]
async fn a_very_long_reason_is_cut_to_a_size_the_api_server_accepts() {
    let outcome = OutcomeRecord {
        outcome: Outcome::Failed,
        reason: format!("health: {}", "é".repeat(20_000)),
        ..done()
    };
    let (_dir, journal, report) = journal_with(outcome);
    let (client, mut server) = mock_client();
    let (reporter, _) = reporter(client, journal);
    let delivery = tokio::spawn(async move { reporter.deliver(&report).await });
    let write = server.expect_status_patch(NAMESPACE, NAME).await;
    let status = write.request.body["status"].clone();
    let reason = status["reason"].as_str().expect("a reason");
    assert!(
        reason.starts_with("health: é") && reason.len() <= 4100,
        "{}",
        reason.len()
    );
    let message = condition(&status, "Stalled")["message"]
        .as_str()
        .expect("a message");
    assert!(message.len() <= 4100, "{}", message.len());
    write.respond_json(StatusCode::OK, &accepted_object());
    assert_eq!(delivery.await.expect("delivery task"), Delivered::Accepted);
}

#[tokio::test]
async fn a_report_is_retried_after_503s_until_accepted_and_only_then_acknowledged() {
    let (_dir, journal, report) = journal_with(done());
    let (client, mut server) = mock_client();
    let (reporter, metrics) = reporter(client, journal.clone());
    let delivery = tokio::spawn(async move { reporter.deliver(&report).await });

    let first = server.expect_status_patch(NAMESPACE, NAME).await;
    let first_body = first.request.body.clone();
    assert_eq!(metrics.journal_backlog(), 1);
    first.respond_status(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        "etcd is unavailable",
    );
    for retry in 1..=2 {
        let again = server.expect_status_patch(NAMESPACE, NAME).await;
        assert_eq!(
            again.request.body, first_body,
            "retry {retry} writes the same status"
        );
        assert_eq!(
            pending(&journal),
            vec![3],
            "still in the journal at retry {retry}"
        );
        assert!(!delivery.is_finished());
        if retry == 1 {
            again.respond_status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "etcd is unavailable",
            );
        } else {
            again.respond_json(StatusCode::OK, &accepted_object());
        }
    }
    let delivered = tokio::time::timeout(kube_support::DEADLINE, delivery)
        .await
        .expect("delivered in time")
        .expect("delivery task");
    assert_eq!(delivered, Delivered::Accepted);
    assert_eq!(pending(&journal), Vec::<i64>::new());
    assert_eq!(metrics.journal_backlog(), 0);
    assert!(
        server.remaining().await.is_empty(),
        "no write after acceptance"
    );
}

#[tokio::test]
async fn a_404_acknowledges_and_drops_the_outcome() {
    let (_dir, journal, report) = journal_with(done());
    let (client, mut server) = mock_client();
    let (reporter, _) = reporter(client, journal.clone());
    let delivery = tokio::spawn(async move { reporter.deliver(&report).await });

    server
        .expect_status_patch(NAMESPACE, NAME)
        .await
        .respond_status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "swapattempts.genswap.dev \"web-node-a-3\" not found",
        );
    let delivered = tokio::time::timeout(kube_support::DEADLINE, delivery)
        .await
        .expect("delivered in time")
        .expect("delivery task");
    assert_eq!(delivered, Delivered::Gone);
    assert_eq!(
        pending(&journal),
        Vec::<i64>::new(),
        "dropped from the journal"
    );
    assert!(server.remaining().await.is_empty(), "not retried");
}

/// A running-status report for `mode` on a task, against a mocked server;
/// cancel the returned token when the attempt ends.
fn reporting_started(
    mode: Mode,
) -> (
    kube_support::ApiServerVerifier,
    tokio::task::JoinHandle<()>,
    Cancel,
) {
    let (dir, journal, report) = journal_with(done());
    let (client, server) = mock_client();
    let (reporter, _) = reporter(client, journal);
    let until = Cancel::new();
    let started = tokio::spawn({
        let until = until.clone();
        async move {
            reporter
                .report_started(&report.target, mode, STARTED_MS, &until)
                .await;
            drop(dir);
        }
    });
    (server, started, until)
}

#[tokio::test]
async fn the_running_status_says_reconciling_with_the_start_and_no_outcome() {
    let (mut server, started, _until) = reporting_started(Mode::Hold);
    let write = server.expect_status_patch(NAMESPACE, NAME).await;
    assert_eq!(
        write.request.query.get("fieldManager").map(String::as_str),
        Some(FIELD_MANAGER)
    );
    let status = write.request.body["status"].clone();
    assert!(status.get("outcome").is_none(), "{status:#}");
    assert_eq!(status["startedAt"], "2025-06-15T15:06:40Z");
    assert_eq!(status["effectiveMode"], "hold");
    let reconciling = condition(&status, "Reconciling");
    assert_eq!(
        (
            reconciling["status"].as_str(),
            reconciling["reason"].as_str()
        ),
        (Some("True"), Some("Running"))
    );
    assert_eq!(condition(&status, "Ready")["status"], "False");
    assert_eq!(condition(&status, "Stalled")["status"], "False");
    write.respond_json(StatusCode::OK, &accepted_object());
    tokio::time::timeout(kube_support::DEADLINE, started)
        .await
        .expect("done in time")
        .expect("task");
    assert!(server.remaining().await.is_empty());
}

#[tokio::test]
async fn a_failing_running_status_stops_retrying_when_the_attempt_ends() {
    let (mut server, started, until) = reporting_started(Mode::Overlap);
    server
        .expect_status_patch(NAMESPACE, NAME)
        .await
        .respond_status(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "down",
        );
    let retry = server.expect_status_patch(NAMESPACE, NAME).await;
    until.cancel("the attempt finished");
    // The write in flight is answered, never cut off; then no more.
    assert!(!started.is_finished(), "a write in flight is waited for");
    retry.respond_status(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        "down",
    );
    tokio::time::timeout(kube_support::DEADLINE, started)
        .await
        .expect("ends once the attempt ended")
        .expect("task");
    assert!(server.remaining().await.is_empty());
}

#[test]
fn backoff_doubles_to_its_ceiling_and_jitters_below_it() {
    let backoff = ReportBackoff::default();
    assert_eq!(backoff.ceiling(0), Duration::from_millis(200));
    assert_eq!(backoff.ceiling(1), Duration::from_millis(400));
    assert_eq!(backoff.ceiling(4), Duration::from_millis(3_200));
    assert_eq!(backoff.ceiling(5), Duration::from_secs(4));
    assert_eq!(backoff.ceiling(u32::MAX), Duration::from_secs(4));
    let delays: Vec<Duration> = (0..50).map(|_| backoff.delay(3)).collect();
    for delay in &delays {
        assert!(
            (Duration::from_millis(800)..=Duration::from_millis(1600)).contains(delay),
            "{delay:?}"
        );
    }
    assert!(
        delays.iter().any(|d| *d != delays[0]),
        "jittered: {delays:?}"
    );
}
